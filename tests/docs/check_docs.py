#!/usr/bin/env python3
"""check_docs.py — keeps README.md and docs/ true to the tree they describe.

    check_docs.py ROOT                 every check below; exit 1 with one line per problem
    check_docs.py ROOT --extract DIR   write the README's quick-start blocks into DIR

Checks:
  paths     every path written in backticks (a span with a `/` under a top-level folder of
            the tree or ending in a file extension), and every relative link, in README.md and
            docs/*.md exists in the repository (a header as `tpnorm/x.h` under include/), or is
            a build output (a path that git ignores, such as `build/...`), or is absolute
  cited     every docs/*.md or *.md page that a tracked file names exists
  config    the configuration table (a table whose first header cell is "Variable") names every
            environment variable that src/, bench/ and launch/ read, and each of its variables
            appears in that code
  length    README.md has at most 300 lines
  words     no tracked file talks about how it was developed (see check_words)
The quick starts: a fenced block directly after a line `<!-- docs-test: NAME -->` in README.md
is written to DIR/NAME by --extract; tests/docs/quickstart.cmake builds and runs them.
Standard library only, so any python3 runs it.
"""
import os
import re
import subprocess
import sys

EXTENSIONS = ("h", "hpp", "cpp", "c", "cu", "cuh", "py", "md", "txt", "sh", "cmake", "json",
              "toml", "yml", "yaml", "gp", "png", "svg", "csv", "in", "cfg")
TOP_DIRS = ("src", "include", "tests", "bench", "docs", "launch", "examples", "cmake", ".ci")
ENV_PREFIXES = r"(?:TPNORM|OMPI|PMIX|PMI|SLURM|NCCL|CUDA|OMP|ASAN)_[A-Z0-9_]+"
ENV_NAME = re.compile(r"^" + ENV_PREFIXES + r"$")


def tracked(root, *patterns):
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--", *patterns],
                         check=True, capture_output=True, text=True).stdout
    return [p for p in out.split("\0") if p]


def ignored(root, path):
    """True for a path git ignores (a build output), which need not exist."""
    r = subprocess.run(["git", "-C", root, "check-ignore", "-q", "--no-index", path])
    return r.returncode == 0


def doc_files(root):
    return ["README.md"] + sorted(p for p in tracked(root, "docs/*.md"))


def read(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def strip_fences(text):
    """The text outside fenced code blocks (a command in a block is not prose)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def looks_like_path(span):
    if " " in span or "://" in span or span.startswith(("-", "$", "~")):
        return False
    if any(c in span for c in "*<>{}[]()|=,;:'\"`\\"):
        return False
    if span.startswith("/"):
        return False  # a system path
    head = span.split("/")[0]
    if "/" in span and (head in TOP_DIRS or head == "tpnorm" or head.startswith("build")):
        return True
    # A bare file name (`nccl.h`, `summary.txt`) may name a system or output file: only a
    # span with a directory is taken for a path of the tree.
    return "/" in span and re.search(r"\.(" + "|".join(EXTENSIONS) + r")$", span) is not None


def path_exists(root, doc, span):
    span = span.split("#")[0].rstrip("/")
    if not span:
        return True
    candidates = [span, os.path.join("include", span), os.path.join(os.path.dirname(doc), span)]
    for c in candidates:
        if os.path.exists(os.path.join(root, c)):
            return True
    return any(ignored(root, p) for p in (span, span + "/", span + "/x"))


def check_paths(root, problems):
    for doc in doc_files(root):
        text = strip_fences(read(root, doc))
        for span in re.findall(r"`([^`\n]+)`", text):
            if looks_like_path(span) and not path_exists(root, doc, span):
                problems.append(f"{doc}: `{span}` does not exist")
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in link or link.startswith(("#", "mailto:")):
                continue
            target = os.path.normpath(os.path.join(os.path.dirname(doc), link.split("#")[0]))
            if not os.path.exists(os.path.join(root, target)):
                problems.append(f"{doc}: link ({link}) does not exist")


def check_cited(root, problems):
    names = set(tracked(root))
    for rel in tracked(root):
        if rel.endswith((".png", ".svg")) or rel.startswith("tests/docs/"):
            continue
        try:
            text = read(root, rel)
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        for page in set(re.findall(r"(?<![\w/.-])((?:docs/)?[A-Za-z0-9_-]+\.md)\b", text)):
            if page not in names and os.path.join(os.path.dirname(rel), page) not in names:
                problems.append(f"{rel}: names {page}, which is not in the repository")


def config_table(root):
    """(doc, variables) of the table whose header row starts with `Variable`."""
    for doc in doc_files(root):
        lines = read(root, doc).splitlines()
        for i, line in enumerate(lines):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.lstrip().startswith("|") and cells and cells[0] == "Variable":
                names = []
                for row in lines[i + 2:]:
                    if not row.lstrip().startswith("|"):
                        break
                    first = row.strip().strip("|").split("|")[0]
                    names += re.findall(r"`([A-Z][A-Z0-9_]+)`", first)
                return doc, names
    return None, []


def env_reads(root):
    """{variable: first file that reads it} for src/, bench/ and launch/."""
    reads = {}
    for rel in tracked(root, "src", "bench", "launch"):
        try:
            text = read(root, rel)
        except UnicodeDecodeError:
            continue
        found = []
        if rel.endswith((".h", ".hpp", ".cpp", ".c", ".cu", ".cuh")):
            if "getenv" in text:  # string literals of variable names (also in name lists)
                found = [n for n in re.findall(r'"([A-Z][A-Z0-9_]+)"', text) if ENV_NAME.match(n)]
        elif rel.endswith(".py"):
            found = re.findall(r"environ(?:\.get)?\(?\[?\s*[\"'](" + ENV_PREFIXES + r"|[A-Z_]+)[\"']",
                               text)
            found += re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']\s+(?:not\s+)?in\s+os\.environ", text)
            found += re.findall(r"getenv\(\s*[\"']([A-Z][A-Z0-9_]+)[\"']", text)
        elif rel.startswith("launch/") or text.startswith("#!"):
            found = re.findall(r"\$\{?(TPNORM_[A-Z0-9_]+)", text)
        for n in found:
            reads.setdefault(n, rel)
    return reads


def check_config(root, problems):
    doc, names = config_table(root)
    if not doc:
        problems.append("no configuration table (a table whose first header cell is Variable)")
        return
    # The table also documents variables that only the test suite reads (tests/gpu).
    code = "\n".join(read(root, p) for p in tracked(root, "src", "bench", "launch", "tests")
                     if not p.endswith((".png", ".svg")))
    for name, where in sorted(env_reads(root).items()):
        if name not in names:
            problems.append(f"{doc}: the configuration table lacks {name} (read in {where})")
    for name in names:
        if not re.search(r"\b" + name + r"\b", code):
            problems.append(f"{doc}: {name} is in the configuration table but no code reads it")


def check_length(root, problems):
    n = read(root, "README.md").count("\n")
    if n > 300:
        problems.append(f"README.md has {n} lines (at most 300; depth goes to docs/)")


def check_words(root, problems):
    # Built from pieces so that this file does not match itself.
    pattern = "|".join([r"\bsessions?\b", r"issue #?[0-9]+", r"\bengineers\b",
                        "this " + "VM" + r"\b", "development " + "(machine|VM)"])
    r = subprocess.run(["git", "-C", root, "grep", "-nIiE", pattern, "--", "."],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        problems.append(f"speaks of its own development: {line[:160]}")


def extract(root, out_dir):
    text = read(root, "README.md")
    blocks = re.findall(r"^<!-- docs-test: (\S+) -->\n```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    if not blocks:
        sys.exit("README.md has no <!-- docs-test: NAME --> blocks")
    for name, body in blocks:
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
        print(f"extracted {name} ({body.count(chr(10))} lines)")


def main():
    root = os.path.abspath(sys.argv[1])
    if len(sys.argv) == 4 and sys.argv[2] == "--extract":
        extract(root, sys.argv[3])
        return 0
    problems = []
    for check in (check_paths, check_cited, check_config, check_length, check_words):
        check(root, problems)
    for p in problems:
        print(p)
    print(f"docs: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
