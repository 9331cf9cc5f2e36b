#!/usr/bin/env bash
# Checks what the docs claim that a script can check, then builds the API reference with Doxygen
# from docs/Doxyfile and fails on any Doxygen warning (WARN_AS_ERROR = YES): an undocumented public
# name or a broken doc comment fails the run.
#
#   scripts/docs.sh [--checks-only] [--build-tree DIR] [output-dir]
#
# output-dir: default build/docs (HTML in <output-dir>/html). --checks-only: the checks below, no
# Doxygen (about a second). --build-tree (or DDP_DOCS_BUILD_TREE): the tree that build/default/...
# in the docs stands for (default build/default; CI builds it before this stage).
#
# The checks (python3, standard library only; each finding is printed as file:line):
#  1. Build paths. Every build/... path in the code of README.md, CONTRIBUTING.md and docs/*.md
#     (code blocks and `inline` code) exists: build/default/<path> in the build tree. Paths in
#     another preset's tree (CMakePresets.json), in a tree a script makes (build/fuzz, build/docs,
#     build/gpu, ...) or in a tree the same page configures itself (`-B build/x`; `-B build`: the
#     reader's own project or a recorded run) are not checked. Any other build/<x>/ is an error:
#     the scripts build into build/default/. Without the build tree this check is skipped, loudly.
#  2. README's "How fast" quotes docs/benchmarks.md. Every figure there (a decimal number such as
#     0.12 or 1.05x, a percentage or range such as 94-97%, a time such as 858 ms) is in a paragraph
#     that links the section of docs/benchmarks.md it comes from (docs/benchmarks.md#anchor; a
#     table's figures: the paragraph above the table; the header row is not checked), and appears
#     as written (not rounded) in that section, subsections included. The check cannot tell which
#     cell a number came from: a figure that happens to occur elsewhere in the section passes.
#  3. The examples' success lines. Each regular expression examples/CMakeLists.txt expects of an
#     example's output (EXPECT, EXPECT_REGEX, PASS_REGULAR_EXPRESSION) is printable by it: every
#     part of it (split at | and .*) is rendered by a string literal or printf format of the
#     example's source, or of include/ddp (a Manager event's text), with digits and values such
#     as "yes" allowed to come from a conversion. That the line is printed only after the check it
#     names is for review: an example prints "yes" from the comparison it describes, and exits
#     non-zero otherwise.
#  4. Links. Every relative link of those pages ([text](path#anchor)) names a file that exists,
#     and an #anchor names one of its headings (GitHub's rule: lower case, punctuation dropped,
#     spaces to hyphens, -1, -2 for repeats).
#
# CI: `bash scripts/docs.sh` (exit status 0 = no finding and no warnings). With WARN_AS_ERROR = YES
# Doxygen stops at the first warning; set DDP_DOCS_ALL_WARNINGS=1 to list every warning before
# failing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
checks_only=0
tree=${DDP_DOCS_BUILD_TREE:-$root/build/default}
while [ $# -gt 0 ]; do
  case $1 in
    --checks-only) checks_only=1; shift ;;
    --build-tree) tree=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "docs.sh: unknown option $1 (see scripts/docs.sh --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
out=${1:-$root/build/docs}
case $tree in /*) ;; *) tree=$PWD/$tree ;; esac
command -v python3 >/dev/null || { echo "docs.sh: python3 is not installed (Debian: apt-get install python3)" >&2; exit 2; }

checks=0
python3 - "$root" "$tree" <<'PY' || checks=$?
import json, os, re, sys

root, tree = sys.argv[1], sys.argv[2]
os.chdir(root)
problems = []


def report(path, line, msg):
    problems.append(f"{path}:{line}: {msg}")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def md_files():
    files = ["README.md", "CONTRIBUTING.md"] + sorted(
        "docs/" + f for f in os.listdir("docs") if f.endswith(".md"))
    return [f for f in files if os.path.isfile(f)]


# ---- (1) build/... paths --------------------------------------------------------------------
def code_spans(lines):
    """Yields (line number, code text) for the code in a Markdown file: fenced blocks, indented
    blocks (4+ spaces) and `inline` spans (which may break across lines within a paragraph)."""
    fence = None
    inline = False
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*(```+|~~~+)", line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            else:
                yield n, line
            continue
        if m:
            fence, inline = m.group(1), False
            continue
        if not line.strip():
            inline = False
            continue
        if re.match(r"^( {4}|\t)", line) and not inline:
            yield n, line
            continue
        parts = re.split(r"`+", line)
        for k, part in enumerate(parts):
            if k > 0:
                inline = not inline
            if inline:
                yield n, part


def other_trees():
    """Build trees other than build/default: the presets' binary directories and the trees the
    scripts make (build/fuzz, build/docs, ...). Their paths are not checked."""
    trees = set()
    with open("CMakePresets.json", encoding="utf-8") as f:
        presets = json.load(f)
    for p in presets.get("configurePresets", []):
        trees.add(p["name"])
        m = re.search(r"build/([\w.-]+)", p.get("binaryDir", ""))
        if m and "$" not in m.group(1):
            trees.add(m.group(1))
    scripts = [os.path.join("scripts", f) for f in os.listdir("scripts")] + [".ci/run"]
    for s in scripts:
        if not os.path.isfile(s):
            continue
        with open(s, encoding="utf-8", errors="replace") as f:
            text = f.read()
        trees.update(re.findall(r"(?:\$root/|\$\{root\}/|(?<![\w$}/.-]))build/([\w.-]+)", text))
    trees.discard("default")
    return trees


def check_build_paths():
    known = other_trees()
    tree_ok = os.path.isdir(tree)
    if not tree_ok:
        print(f"docs.sh: no build tree at {tree}: the build/default/... paths are not checked"
              " (build first, or pass --build-tree)", file=sys.stderr)
    for path in md_files():
        lines = read(path)
        spans = list(code_spans(lines))
        own = set()  # trees this document configures itself (-B <dir>), wherever it does
        for _, code in spans:
            own.update(re.findall(r"-B\s*[\"']?(?:\./)?(build(?:/[\w.-]+)?)(?![\w./-])", code))
        own_build = "build" in own  # the document's own `-B build` tree: a user's project, a recorded run
        own = {d.split("/")[1] for d in own if "/" in d}
        for n, code in spans:
            for p in re.findall(r"(?<![\w./$-])(?:\./)?(build/[\w.+/-]*)", code):
                p = p.rstrip(".,;:")
                parts = p.split("/")
                first = parts[1] if len(parts) > 1 else ""
                if not first:
                    continue  # build/ or build/<placeholder>
                if first == "default":
                    rest = "/".join(parts[2:])
                    if tree_ok and not os.path.exists(os.path.join(tree, rest)):
                        report(path, n, f"{p}: not in the build tree ({tree}/{rest} does not exist)")
                elif first in known or first in own:
                    continue
                elif own_build:
                    continue
                else:
                    report(path, n, f"{p}: no build makes build/{first}/ (the scripts and the default"
                                    " preset build into build/default/)")


# ---- (2) README's "How fast": each figure names its table in benchmarks.md and is in it -----
def slug(heading, seen):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    s = s.replace(" ", "-")
    if s in seen:
        seen[s] += 1
        s = f"{s}-{seen[s]}"
    else:
        seen[s] = 0
    return s


def sections(path):
    """anchor -> (first line, text of the section, subsections included)."""
    lines = read(path)
    heads, fence, seen = [], None, {}
    for n, line in enumerate(lines):
        m = re.match(r"^\s*(```+|~~~+)", line)
        if m:
            fence = None if fence else m.group(1)
            continue
        h = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if h:
            heads.append((n, len(h.group(1)), slug(h.group(2), seen)))
    out = {}
    for k, (n, level, anchor) in enumerate(heads):
        end = len(lines)
        for n2, level2, _ in heads[k + 1:]:
            if level2 <= level:
                end = n2
                break
        out[anchor] = (n + 1, "\n".join(lines[n:end]))
    return out


FIGURE = re.compile(
    r"(?<![\w.])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?%"   # 94-97%
    r"|\d+(?:\.\d+)? ?ms\b"                            # 858 ms, 9.0 ms
    r"|\d+\.\d+(?!\.?\d))")                            # 0.12, 1.05(x)


def figures(text):
    text = re.sub(r"`[^`]*`", " ", text)              # code: flags, sizes in options
    text = re.sub(r"\]\([^)]*\)", "]", text)          # link targets
    return [m.group(1) for m in FIGURE.finditer(text)]


def occurs(figure, text):
    if figure.endswith("%"):
        return re.search(r"(?<![\d.])" + re.escape(figure), text) is not None
    number = re.sub(r" ?ms$", "", figure)
    return re.search(r"(?<![\d.])" + re.escape(number) + r"(?!\.?\d)", text) is not None


def check_how_fast():
    lines = read("README.md")
    start = next((n for n, l in enumerate(lines) if re.match(r"^## How fast", l)), None)
    if start is None:
        report("README.md", 1, 'no "## How fast" section')
        return
    end = next((n for n in range(start + 1, len(lines)) if lines[n].startswith("## ")), len(lines))
    bench = sections("docs/benchmarks.md")
    blocks, cur = [], []
    for n in range(start + 1, end):
        if lines[n].strip():
            cur.append((n + 1, lines[n]))
        elif cur:
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    caption = []
    for block in blocks:
        text = "\n".join(l for _, l in block)
        table = all(l.lstrip().startswith("|") for _, l in block)
        links = re.findall(r"\]\(docs/benchmarks\.md(#[^)\s]*)?\)", text)
        if table:
            rows = block[2:] if len(block) > 2 and re.match(r"^\s*\|[\s:|-]+\|\s*$", block[1][1]) else block
            anchors = caption
        else:
            rows = block
            anchors = [a[1:] for a in links if a]
            if any(not a for a in links):
                report("README.md", block[0][0], "a link to docs/benchmarks.md without a section"
                       " (#anchor): name the table the figures come from")
            caption = anchors
        for a in anchors:
            if a not in bench and not table:
                report("README.md", block[0][0], f"docs/benchmarks.md#{a}: no such section")
        linked = bool(anchors)
        anchors = [a for a in anchors if a in bench]
        for n, l in rows:
            for fig in figures(l):
                if linked and not anchors:
                    continue  # the broken link is reported
                if not anchors:
                    report("README.md", n, f"{fig}: no link to the docs/benchmarks.md section it comes"
                                           " from in this paragraph (for a table: the paragraph above it)")
                elif not any(occurs(fig, bench[a][1]) for a in anchors):
                    where = ", ".join(f"#{a} (line {bench[a][0]})" for a in anchors)
                    report("README.md", n, f"{fig} does not appear in docs/benchmarks.md{where}")


# ---- (3) every example's success line (the regex ctest matches) is printed by its source -----
def cmake_unescape(s):
    return re.sub(r"\\(.)", r"\1", s)


def sample(piece):
    """A string the regex piece (no alternation, no .*) matches, or None."""
    out, k = [], 0
    while k < len(piece):
        c = piece[k]
        if c == "\\" and k + 1 < len(piece):
            nxt = piece[k + 1]
            if nxt in "dw":
                out.append("0")
            elif nxt == "s":
                out.append(" ")
            else:
                out.append(nxt)
            k += 2
        elif c == "[":
            close = piece.find("]", k + 2)
            if close < 0:
                return None
            body = piece[k + 1:close]
            out.append("0" if body.startswith("^") else body[0])
            k = close + 1
        elif c in "()^$":
            k += 1
        elif c in "+":
            k += 1
        elif c in "*?":
            if out:
                out.pop()
            k += 1
        elif c == ".":
            out.append(".")
            k += 1
        else:
            out.append(c)
            k += 1
    return "".join(out)


def split_top(regex, sep):
    parts, depth, cls, cur, k = [], 0, False, "", 0
    while k < len(regex):
        c = regex[k]
        if c == "\\" and k + 1 < len(regex):
            cur += regex[k:k + 2]
            k += 2
            continue
        if cls:
            cls = c != "]"
        elif c == "[":
            cls = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        if not cls and depth == 0 and regex.startswith(sep, k):
            parts.append(cur)
            cur, k = "", k + len(sep)
            continue
        cur += c
        k += 1
    parts.append(cur)
    return parts


C_ESC = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "0": "\0"}
CONV = re.compile(r"%[-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|j|z|t|L)?[diouxXfFeEgGaAcsp]")


def literals(src):
    """The program's string literals (adjacent ones joined) as token lists: a character, or None for
    a printf conversion (which prints anything)."""
    src = re.sub(r"//[^\n]*|/\*.*?\*/", " ", src, flags=re.S)
    out = []
    for m in re.finditer(r'"(?:[^"\\\n]|\\.)*"(?:\s*"(?:[^"\\\n]|\\.)*")*', src):
        body = "".join(re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(0)))
        text = re.sub(r"\\(.)", lambda e: C_ESC.get(e.group(1), e.group(1)), body)
        tokens, k = [], 0
        while k < len(text):
            if text.startswith("%%", k):
                tokens.append("%")
                k += 2
                continue
            c = CONV.match(text, k)
            if c:
                tokens.append(None)
                k = c.end()
                continue
            tokens.append(text[k])
            k += 1
        out.append(tokens)
    return out


def best_literal_match(s, tokens):
    """Most characters of s matched by literal characters of one rendering of tokens, s being a
    substring of that rendering; -1 if s cannot be one."""
    ls, lt = len(s), len(tokens)
    NEG = -1 << 30
    # f[i][j]: best for s[i:] from token j; s may end anywhere.
    f = [[NEG] * (lt + 1) for _ in range(ls + 1)]
    for j in range(lt + 1):
        f[ls][j] = 0
    for i in range(ls - 1, -1, -1):
        for j in range(lt - 1, -1, -1):
            t = tokens[j]
            if t is None:
                f[i][j] = max(f[k][j + 1] for k in range(i, ls + 1))
                if j + 1 == lt:  # a conversion at the end may print the rest
                    f[i][j] = max(f[i][j], 0)
            elif t == s[i]:
                f[i][j] = 1 + f[i + 1][j + 1]
    return max(max(f[0][j] for j in range(lt)), -1) if lt else -1


def check_example_expectations():
    path = "examples/CMakeLists.txt"
    text = open(path, encoding="utf-8").read()
    variables = dict((m.group(1), m.group(2))
                     for m in re.finditer(r'set\((\w+)\s+"((?:[^"\\]|\\.)*)"\)', text))
    owners = [(m.start(), next(g for g in m.groups() if g)) for m in re.finditer(
        r"ddp_add_example\((\w+)|\$<TARGET_FILE:(\w+)>|add_test\(NAME example\.(\w+)", text)]
    cache, raw = {}, {}
    headers = sorted(os.path.join(d, f) for d, _, fs in os.walk("include/ddp") for f in fs if f.endswith(".hpp"))
    for m in re.finditer(r'(?:EXPECT\s+"|-DEXPECT_REGEX=|PASS_REGULAR_EXPRESSION\s+")((?:[^"\\]|\\.)*)"', text):
        expect = m.group(1)
        line = text.count("\n", 0, m.start()) + 1
        regex = re.sub(r"\$\{(\w+)\}", lambda v: variables.get(v.group(1), v.group(0)), expect)
        if "${" in regex:
            continue  # the function's own ${A_EXPECT}
        regex = cmake_unescape(regex)
        name = max(((p, n) for p, n in owners if p < m.start()), default=(0, None))[1]
        src = next((f"examples/{name}{e}" for e in (".cpp", ".cu") if name and os.path.isfile(f"examples/{name}{e}")), None)
        if src is None:
            report(path, line, f"cannot tell which example the expected output belongs to ({name})")
            continue
        # A test run by the supervisor may also expect the supervisor's own lines.
        block = text[text.rfind("add_test(", 0, m.start()):m.start()]
        supervisor = ["scripts/ddp-supervise"] if "ddp_supervise" in block or "ddp-supervise" in block else []
        for alt in split_top(regex, "|"):
            for piece in split_top(alt, ".*"):
                s = sample(piece)
                if s is None or sum(ch.isalpha() for ch in s) < 4:
                    continue
                words = re.findall(r"[A-Za-z]{4,}", s)
                need = max(4, (len(s) * 6 + 9) // 10)
                # the example's own literals first, then the library's (a Manager event's text)
                found = False
                for f in [src] + supervisor + headers:
                    if f not in raw:
                        raw[f] = open(f, encoding="utf-8", errors="replace").read()
                        if f in supervisor:  # Python: an f-string's {field} prints anything
                            raw[f] = re.sub(r"\{[^{}\"\n]*\}", "%s", raw[f])
                    if words and not any(w in raw[f] for w in words):
                        continue
                    if f not in cache:
                        cache[f] = literals(raw[f])
                    for tokens in cache[f]:
                        lit = "".join(t for t in tokens if t)
                        if words and not any(w in lit for w in words):
                            continue
                        if best_literal_match(s, tokens) >= need:
                            found = True
                            break
                    if found:
                        break
                if not found:
                    where = " nor ".join([src] + supervisor)
                    report(path, line, f'"{piece}": neither {where} nor include/ddp prints such a line (no'
                                       f" string literal or printf format renders {s!r})")


# ---- (4) relative links: the file exists, the #anchor is one of its headings ------------------
def check_links():
    anchors = {}
    for path in md_files():
        fence = None
        for n, line in enumerate(read(path), 1):
            m = re.match(r"^\s*(```+|~~~+)", line)
            if m:
                fence = None if fence else m.group(1)
                continue
            if fence:
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                if not os.path.exists(full):
                    report(path, n, f"{target}: no such file")
                elif anchor and full.endswith(".md"):
                    if full not in anchors:
                        anchors[full] = sections(full)
                    if anchor not in anchors[full]:
                        report(path, n, f"{target}: no heading of {full} makes #{anchor}")


check_build_paths()
check_how_fast()
check_example_expectations()
check_links()
for p in problems:
    print("docs.sh: " + p, file=sys.stderr)
if problems:
    print(f"docs.sh: {len(problems)} problem(s) in the docs' checked claims", file=sys.stderr)
    sys.exit(1)
print("docs.sh: build paths" + ("" if os.path.isdir(tree) else " (but those in build/default)")
      + ", README's benchmark figures, the examples' expected lines and the links check out")
PY

[ "$checks_only" = 0 ] || exit "$checks"
command -v doxygen >/dev/null || { echo "docs.sh: doxygen is not installed (Debian: apt-get install doxygen)" >&2; exit 2; }
mkdir -p "$out"
export DDP_DOCS_OUT=$out
cd "$root"
if [ "${DDP_DOCS_ALL_WARNINGS:-0}" = 1 ]; then
  # FAIL_ON_WARNINGS (Doxygen >= 1.9.3) reports every warning, then fails.
  (cat docs/Doxyfile; echo "WARN_AS_ERROR = FAIL_ON_WARNINGS") | doxygen -
else
  doxygen docs/Doxyfile
fi
echo "docs.sh: API reference in $out/html/index.html"
exit "$checks"
