#!/usr/bin/env python3
"""Checks the book under docs/src and README.md, as scripts/docs runs it:

1. Links. Every relative link in docs/src/*.md and README.md goes to a file of the
   repository, and every `#anchor` (alone, or after a Markdown file) to a heading of that
   page, with the heading ids GitHub and mdBook both give: the heading's text lower-cased,
   each space a `-`, every other character but letters, digits, `-` and `_` dropped, and
   `-1`, `-2`, ... after a repeated id. Every page of docs/src is in SUMMARY.md.
2. Configuration keys. Every table and key of config/reference.toml, those of its
   commented-out examples included (`# key = value` lines, `# [table]` headers), is
   documented: some page has a heading that names the table (`[imds]`, `[[approvals.keys]]`
   in backticks; a sink kind as `kind = "nats"`), and the key is in backticks (`key`,
   `key = ...` or `table.key`) in the text under that heading before its first sub-heading,
   or under the heading's parents before theirs (where keys common to every sink kind are).

Prints each problem with its file and line, and exits 1 if there is any.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "docs" / "src"

problems = []


def problem(path, line, message):
    problems.append(f"{path.relative_to(ROOT)}:{line}: {message}")


def prose_lines(text):
    """(line number, line) outside fenced code blocks; inline code is left in place."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)
                continue
            if stripped.startswith(fence):
                fence = None
                continue
        if fence is None:
            yield number, line


def headings(text):
    """(line number, level, text) of every ATX heading outside code blocks."""
    for number, line in prose_lines(text):
        match = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            yield number, len(match.group(1)), match.group(2)


def heading_id(heading):
    """The id GitHub and mdBook give a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.lower()
    return "".join(
        "-" if c.isspace() else c for c in text if c.isalnum() or c in "-_" or c.isspace()
    )


def anchors(path, cache={}):
    if path not in cache:
        ids, seen = set(), {}
        for _, _, heading in headings(path.read_text()):
            base = heading_id(heading)
            count = seen.get(base, 0)
            seen[base] = count + 1
            ids.add(base if count == 0 else f"{base}-{count}")
        cache[path] = ids
    return cache[path]


def without_code_spans(line):
    return re.sub(r"(`+)(.+?)\1", "", line)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


def check_links(path):
    text = path.read_text()
    for number, line in prose_lines(text):
        bare = without_code_spans(line)
        targets = [m.group(1) for m in LINK.finditer(bare)]
        targets += [m.group(1) for m in [REFERENCE.match(bare)] if m]
        for target in targets:
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists():
                problem(path, number, f"broken link {target}: {file_part} does not exist")
                continue
            try:
                destination.relative_to(ROOT)
            except ValueError:
                problem(path, number, f"link {target} leaves the repository")
                continue
            if anchor:
                if destination.suffix != ".md":
                    problem(path, number, f"link {target}: an anchor into a file that is not Markdown")
                elif anchor not in anchors(destination):
                    problem(
                        path,
                        number,
                        f"broken anchor {target}: {destination.relative_to(ROOT)} has no heading with the id {anchor!r}",
                    )


def check_summary():
    summary = SRC / "SUMMARY.md"
    listed = {
        (SRC / m.group(1)).resolve()
        for _, line in prose_lines(summary.read_text())
        for m in LINK.finditer(line)
    }
    for page in sorted(SRC.rglob("*.md")):
        if page != summary and page.resolve() not in listed:
            problem(page, 1, "this page is not in SUMMARY.md, so it is not in the book")


# config/reference.toml: a table header, or a key, written as TOML or commented out as an
# example (`# key = value`). `# # ...` is a comment inside a commented-out example.
TABLE = re.compile(r"^(?:#\s)?\s*\[\[?([a-z][a-z0-9_.]*)\]\]?\s*(?:#.*)?$")
KEY = re.compile(r"^(?:#\s)?\s*([a-z][a-z0-9_]*)\s*=\s*\S")


def reference_keys():
    """{(table, kind): [(key, line)]} of config/reference.toml, in file order."""
    tables = {}
    current = None
    path = ROOT / "config" / "reference.toml"
    for number, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("# #"):
            continue
        table = TABLE.match(line)
        if table:
            current = [table.group(1), None, number]
            continue
        key = KEY.match(line)
        if key and current:
            name = key.group(1)
            if current[0] == "sinks" and name == "kind":
                kind = re.search(r'=\s*"([a-z]+)"', line).group(1)
                current[1] = kind
            tables.setdefault((current[0], current[2]), [current, []])[1].append((name, number))
    merged = {}
    for (table, _), (header, keys) in tables.items():
        where = (table, header[1])
        merged.setdefault(where, [])
        for key in keys:
            if key[0] not in [k for k, _ in merged[where]]:
                merged[where].append(key)
    return merged


def sections(path):
    """Each heading of a page: its text, the text under it before the next heading of any
    level, and the indices of the headings it is under."""
    text = path.read_text().split("\n")
    found = list(headings("\n".join(text)))
    result = []
    for index, (number, level, heading) in enumerate(found):
        end = found[index + 1][0] - 1 if index + 1 < len(found) else len(text)
        parents, above = [], level
        for other in range(index - 1, -1, -1):
            if found[other][1] < above:
                parents.append(other)
                above = found[other][1]
        result.append((heading, "\n".join(text[number:end]), parents))
    return result


def check_reference():
    homes_by_page = {page: sections(page) for page in sorted(SRC.rglob("*.md"))}
    reference = ROOT / "config" / "reference.toml"
    for (table, kind), keys in reference_keys().items():
        if table == "sinks" and kind:
            what = f'[[sinks]] kind = "{kind}"'
            names = lambda heading: f'`kind = "{kind}"`' in heading
        else:
            what = f"[{table}]"
            pattern = re.compile(r"`\[\[?" + re.escape(table) + r"\]\]?`")
            names = lambda heading: pattern.search(heading) is not None
        homes = [
            (page, index)
            for page, found in homes_by_page.items()
            for index, (heading, _, _) in enumerate(found)
            if names(heading)
        ]
        if not homes:
            problem(reference, keys[0][1], f"no page under docs/src has a heading naming {what}")
            continue
        for key, number in keys:
            span = re.compile(
                r"`(?:" + re.escape(table) + r"\.)?" + re.escape(key) + r"(?:\s*=[^`]*)?`"
            )
            documented = False
            for page, index in homes:
                found = homes_by_page[page]
                bodies = [found[index][1]] + [found[p][1] for p in found[index][2]]
                documented = documented or any(span.search(body) for body in bodies)
            if not documented:
                places = ", ".join(f'{p.relative_to(ROOT)} "{homes_by_page[p][i][0]}"' for p, i in homes)
                problem(reference, number, f"{what} {key} is documented nowhere: add `{key}` under {places}")


def main():
    pages = sorted(SRC.rglob("*.md")) + [ROOT / "README.md"]
    for page in pages:
        check_links(page)
    check_summary()
    check_reference()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    keys = sum(len(k) for k in reference_keys().values())
    print(
        f"check-docs: {len(pages)} pages, every link and anchor resolves; "
        f"{keys} keys of config/reference.toml, each documented under its section"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
