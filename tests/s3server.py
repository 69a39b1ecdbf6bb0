"""A real S3-compatible server for the tests: moto's server mode, started as its own process on loopback.

Not a patched function: the code under test talks HTTP to a separate process through s3fs/botocore, as it
would to S3. The server enforces conditional writes (`If-None-Match: *` answers 412 when the key exists),
which the commit protocol relies on; `S3Server.check_conditional_writes` proves it at start-up, so a moto
that stopped enforcing them fails the tests loudly instead of letting two commits both win.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint_url: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        """Environment for a child process (a CLI run, a Ray worker) to reach this server through fsspec/s3fs."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    @property
    def storage_options(self) -> dict:
        """fsspec `storage_options` for s3fs in this process."""
        return {"key": CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]}}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            region_name=CREDENTIALS["AWS_DEFAULT_REGION"])

    def make_bucket(self, prefix: str = "dipaco-test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    def check_conditional_writes(self) -> None:
        from botocore.exceptions import ClientError

        bucket, s3 = self.make_bucket("precondition"), self.client()
        s3.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
        try:
            s3.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
        except ClientError as e:
            assert e.response["Error"]["Code"] == "PreconditionFailed", e.response
        else:
            raise AssertionError("the S3 test server accepted a second If-None-Match: * write")
        assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_s3_server(timeout: float = 30.0) -> S3Server:
    """Start `python -m moto.server` on a free loopback port and wait until it answers."""
    pytest = __import__("pytest")
    pytest.importorskip("moto.server", reason="the S3 test server needs moto's server mode: pip install 'moto[server]'")
    pytest.importorskip("s3fs", reason="s3:// paths need s3fs: pip install -e '.[s3]'")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **CREDENTIALS})
    server, deadline = S3Server(f"http://127.0.0.1:{port}", proc), time.monotonic() + timeout
    while True:
        try:
            server.client().list_buckets()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"the moto S3 server did not start on port {port}")
            time.sleep(0.2)
    server.check_conditional_writes()
    return server
