"""Joining a Ray cluster, or starting a local one that only this machine can reach (one of the two files that import
ray; the other is ``dipaco.taskqueue.ray_engine``, and the sharding engine's Ray blocks connect through here too).

``connect(address, cpus)``:

  ``address`` empty   a local Ray on this machine, every process bound to 127.0.0.1 (GCS, raylet, object manager,
                      workers) and no dashboard: anyone who reaches a Ray port can run code on it, so the local Ray
                      has no port on any other interface (the torchrun engine keeps to 127.0.0.1 too)
  ``address`` given   the cluster at ``host:port`` (or ``auto``); its GCS port is probed first, so an address where
                      nothing listens costs one line within seconds (not Ray's endless connection warnings), and
                      ``ray.init`` is given a deadline. A connection without token authentication
                      (``RAY_AUTH_MODE=token``, Ray 2.52 or later) works and warns once per process tree.

A token missing or other than the cluster's is refused in one line, within a second, before ``ray.init`` (an
error of the command, not of the cluster: ``--keep-going`` ends on it). ``ClusterUnreachable`` (a DipacoError) says
the cluster could not be reached: ``--keep-going`` waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading

from dipaco.errors import DipacoError
from dipaco.children import watch_local_ray

# Ray decides a node's address when it starts: with its "cluster" mode off it takes the loopback address, and its
# servers listen on 127.0.0.1 only (they do when their node's address is 127.0.0.1). Read by ray on import and by
# the processes it starts (they inherit the environment), so it is set before ray is imported for a local Ray.
_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WARNED = "DIPACO_RAY_AUTH_WARNED"  # the warning is given once per process tree (a --keep-going parent tells its children)
INIT_DEADLINE_S = 45.0
TOKEN_PROBE_S = 10.0
_watcher = None  # the watcher of the local Ray this process started (dipaco.children.watch_local_ray)


class ClusterUnreachable(DipacoError):
    """No Ray cluster answered at the address (or it went away): a loss of machines, not a user error."""


def start_hint(address: str) -> str:
    port = address.rsplit(":", 1)[-1] if ":" in address else "6379"
    return (f"start one with `RAY_AUTH_MODE=token ray start --head --port {port}` on that machine (README: Ray "
            f"clusters), or leave --address out to use a local Ray")


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` address; None for 'auto' (Ray finds the cluster on this machine)."""
    if address == "auto":
        return None
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DipacoError(f"--address {address!r} is not host:port (e.g. 10.0.0.5:6379) or 'auto'; pass the address "
                          f"that `ray start --head` printed")
    return host.strip("[]"), int(port)


def reachable(address: str, timeout: float = 3.0) -> str | None:
    """None when something accepts TCP connections at the address's port, else why not (one line)."""
    target = split_address(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def connect(address: str = "", cpus: int | None = None, env: dict | None = None) -> dict:
    """Connect this process to Ray (see the module docstring); ``env``: variables every task sees. Returns
    {"address": the GCS address, "local": bool}."""
    if not address:
        os.environ[_LOCAL_ONLY] = "0"
    import ray
    from ray._private import ray_constants

    opts = dict(logging_level=logging.ERROR, log_to_driver=False, runtime_env={"env_vars": dict(env or {})})
    if not address:
        ray_constants.ENABLE_RAY_CLUSTER = False  # ray was imported before: the same switch, read when it starts
        # address="local": a new Ray of our own, never one that `ray start` left running on this machine
        ray.init(address="local", num_cpus=cpus or os.cpu_count(), include_dashboard=False,
                 object_store_memory=256 << 20, **opts)
        global _watcher  # this Ray's processes end with this one, SIGKILLed or not (dipaco.children)
        _watcher = watch_local_ray(getattr(ray._private.worker._global_node, "session_name", ""))
        return {"address": ray.get_runtime_context().gcs_address, "local": True}
    why = reachable(address)
    if why:
        raise ClusterUnreachable(f"no Ray cluster answers at --address {address} ({why}); {start_hint(address)}")
    _check_token(ray, address)
    _init_with_deadline(ray, address, opts)
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token" and not os.environ.get(_WARNED):
        os.environ[_WARNED] = "1"
        print(f"dipaco: warning: connected to the Ray cluster at {address} without token authentication: anyone who "
              f"reaches its ports can run code on it; start it (and this command) with RAY_AUTH_MODE=token "
              f"(README: Ray clusters)", file=sys.stderr)
    return {"address": ray.get_runtime_context().gcs_address, "local": False}


def _check_token(ray, address: str) -> None:
    """One GCS request with this process's token settings, before ``ray.init``: a token missing or other than the
    cluster's is one line within a second (``ray.init`` would retry for its whole deadline, a warning a second)."""
    try:
        from ray._raylet import GcsClient  # Ray's own client: it sends the token as ray.init would
    except ImportError:
        return
    if split_address(address) is None:
        return
    result: list = []

    def probe():
        try:
            GcsClient(address=address)
            result.append(None)
        except BaseException as exc:  # handed to the caller's thread
            result.append(exc)

    with _quiet_stderr():  # Ray's native client logs the refusal itself, once, before raising it
        t = threading.Thread(target=probe, daemon=True, name="ray-token-probe")
        t.start()
        t.join(TOKEN_PROBE_S)
    if not (result and isinstance(result[0], getattr(ray.exceptions, "AuthenticationError", ()))):
        return  # answered, or not in time, or another failure: ray.init decides, within its deadline
    where = f"the Ray cluster at --address {address}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        raise DipacoError(f"{where} requires a token and this command has none (RAY_AUTH_MODE is not 'token'): run it "
                          f"with RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (`ray get-auth-token` "
                          f"prints it on the head machine) or in ~/.ray/auth_token")
    raise DipacoError(f"{where} refused this command's token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                      f"~/.ray/auth_token): it is not the cluster's; set RAY_AUTH_TOKEN to the token "
                      f"`ray get-auth-token` prints on the head machine")


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _init_with_deadline(ray, address: str, opts: dict) -> None:
    """``ray.init(address=...)`` that gives up after INIT_DEADLINE_S (a port that answers but is not a Ray GCS, or a
    head that is still starting, would otherwise keep it retrying for minutes)."""
    failure: list[BaseException] = []

    def attempt():
        try:
            ray.init(address=address, **opts)
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    t = threading.Thread(target=attempt, daemon=True, name="ray-init")
    t.start()
    t.join(INIT_DEADLINE_S)
    if t.is_alive():
        raise ClusterUnreachable(f"the Ray cluster at --address {address} did not answer within {INIT_DEADLINE_S:.0f} s; "
                                 f"{start_hint(address)}")
    if failure:
        exc = failure[0]
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ClusterUnreachable(f"could not join the Ray cluster at --address {address} ({first}); "
                                 f"{start_hint(address)}") from None


def disconnect() -> None:
    """Leave Ray; a local Ray is stopped, and whatever of it outlives ``ray.shutdown`` is killed."""
    import ray

    global _watcher
    try:
        ray.shutdown()
    finally:
        if _watcher is not None:
            _watcher.stdin.close()  # the watcher ends this Ray's stragglers now, not at this process's end
            _watcher.wait(timeout=30)
            _watcher = None

