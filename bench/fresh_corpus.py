"""A fresh four-domain corpus from files on this machine outside the repository and outside ../shared: text dipaco
was never tuned on (the dev corpora are the shared corpus and the quickstart's default corpus).

    python bench/fresh_corpus.py OUT.jsonl [--budget 1500000]

  javascript   npm's own JavaScript sources (/usr/lib/node_modules/npm/**/*.js, minified files skipped)
  manpages     section-1 manual pages, troff source (/usr/share/man/man1/*.1.gz)
  rust-book    "The Rust Programming Language" as installed by rustup (its chapter pages), HTML markup stripped
  changelogs   Debian package changelogs (/usr/share/doc/*/changelog.Debian.gz)

Files are read in sorted order, cut into documents of at most 3,000 characters at blank lines, until each domain
has ``--budget`` characters; the same machine gives the same file (JSON lines: text, domain, source). A domain
whose files are absent is left out, and said so; fewer than two domains is an error.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import sys
from html.parser import HTMLParser
from pathlib import Path

DOMAINS = {
    "javascript": ["/usr/lib/node_modules/npm/**/*.js"],
    "manpages": ["/usr/share/man/man1/*.1.gz"],
    "rust-book": [str(Path.home() / ".rustup/toolchains/stable-*/share/doc/rust/html/book/ch*.html")],
    "changelogs": ["/usr/share/doc/*/changelog.Debian.gz"],
}
MAX_DOC = 3000


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style", "nav", "head")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style", "nav", "head") and self.skip > 0
        if tag in ("p", "pre", "li", "h1", "h2", "h3", "div"):
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def read(path: str) -> str:
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else Path(path).read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if path.endswith(".html"):
        parser = _Text()
        parser.feed(text)
        text = "".join(parser.parts)
    return "\n\n".join(p.strip() for p in text.split("\n\n") if p.strip())


def documents(text: str) -> list[str]:
    """Paragraph-aligned pieces of at most MAX_DOC characters (a longer paragraph is cut)."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        while len(para) > MAX_DOC:
            out.append(para[:MAX_DOC])
            para = para[MAX_DOC:]
        if len(cur) + len(para) + 2 > MAX_DOC and cur:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return [d for d in out if len(d) >= 200]


def build(out: Path, budget: int) -> dict[str, int]:
    counts = {}
    with open(out, "w", encoding="utf-8") as f:
        for domain, patterns in DOMAINS.items():
            files = sorted({p for pat in patterns for p in glob.glob(pat, recursive=True)})
            used = 0
            for path in files:
                text = read(path)
                if domain == "javascript" and text.count("\n") * 300 < len(text):  # minified
                    continue
                for doc in documents(text):
                    if used >= budget:
                        break
                    f.write(json.dumps({"text": doc, "domain": domain, "source": path}) + "\n")
                    used += len(doc)
            if used:
                counts[domain] = used
            else:
                print(f"fresh_corpus: no files for {domain} ({', '.join(patterns)}); left out", file=sys.stderr)
    if len(counts) < 2:
        raise SystemExit(f"fresh_corpus: only {len(counts)} domain(s) found on this machine; need at least 2")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=int, default=1_500_000, help="characters per domain")
    args = ap.parse_args(argv)
    counts = build(args.out, args.budget)
    print(f"wrote {args.out}: " + ", ".join(f"{d} {n:,} chars" for d, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
