#!/usr/bin/env python3
"""Renders deploy/helm/sched-relay like `helm template`, for scripts/check-deploy.

Helm itself is in none of the package registries this project's machines reach, so this
implements the part of Go's text/template and Helm's functions that the chart uses:
`{{ .Values.x }}`, `$`, `.`, `{{- -}}` trimming, `if`/`else`/`with`/`end`, pipelines, and the
functions toYaml, nindent, indent, quote, default and not. Anything else in a template is an
error naming the template and the action, so the chart cannot quietly grow past what is
checked. Missing values are errors too (Helm would render them empty).

    scripts/render-chart.py CHART_DIR [VALUES.yaml ...] > manifests.yaml
"""
import pathlib
import re
import shlex
import sys

import yaml


class TemplateError(Exception):
    pass


ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def parse(text, where):
    """Splits a template into a tree: strings, ("expr", e) and ("if"|"with", e, then, else)."""
    pieces, pos = [], 0
    for match in ACTION.finditer(text):
        pieces.append(["text", text[pos:match.start()]])
        pieces.append(["action", match.group(2), match.group(1) == "-", match.group(3) == "-"])
        pos = match.end()
    pieces.append(["text", text[pos:]])
    for i, piece in enumerate(pieces):
        if piece[0] == "action":
            if piece[2]:
                pieces[i - 1][1] = pieces[i - 1][1].rstrip()
            if piece[3]:
                pieces[i + 1][1] = pieces[i + 1][1].lstrip()
    root = []
    stack = [(root, None)]
    for piece in pieces:
        body = stack[-1][0]
        if piece[0] == "text":
            if piece[1]:
                body.append(piece[1])
            continue
        action = piece[1]
        if action.startswith("/*"):
            continue
        word = action.split(None, 1)[0] if action else ""
        if word in ("if", "with"):
            node = [word, action[len(word):].strip(), [], []]
            body.append(node)
            stack.append((node[2], node))
        elif word == "else":
            if action != "else" or stack[-1][1] is None:
                raise TemplateError(f"{where}: unsupported or misplaced {{{{ {action} }}}}")
            stack[-1] = (stack[-1][1][3], stack[-1][1])
        elif word == "end":
            if stack[-1][1] is None:
                raise TemplateError(f"{where}: {{{{ end }}}} without a block")
            stack.pop()
        elif word in ("range", "define", "template", "block", "include", "tpl"):
            raise TemplateError(f"{where}: {{{{ {action} }}}} is not supported by this renderer")
        else:
            body.append(["expr", action])
    if len(stack) != 1:
        raise TemplateError(f"{where}: a block is not closed with {{{{ end }}}}")
    return root


def truthy(value):
    return value not in (None, False, 0, "", [], {})


def lookup(path, base, where):
    value = base
    for key in [k for k in path.split(".") if k]:
        if not isinstance(value, dict) or key not in value:
            raise TemplateError(f"{where}: no value at {path}")
        value = value[key]
    return value


def to_yaml(value):
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n")


def indent(spaces, text):
    return "\n".join(" " * int(spaces) + line if line else line for line in str(text).split("\n"))


def quote(value):
    text = format_value(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


FUNCTIONS = {
    "toYaml": lambda v: to_yaml(v),
    "nindent": lambda n, v: "\n" + indent(n, v),
    "indent": lambda n, v: indent(n, v),
    "quote": quote,
    "default": lambda d, v: v if truthy(v) else d,
    "not": lambda v: not truthy(v),
}


def term(token, dot, root, where):
    if token == ".":
        return dot
    if token.startswith("$"):
        return lookup(token[1:], root, where)
    if token.startswith("."):
        return lookup(token, dot, where)
    if re.fullmatch(r"-?\d+", token):
        return int(token)
    if token in ("true", "false"):
        return token == "true"
    if token.startswith('"'):
        return token[1:-1]
    raise TemplateError(f"{where}: cannot evaluate {token!r}")


def evaluate(expr, dot, root, where):
    value, first = None, True
    for command in expr.split("|"):
        tokens = shlex.split(command, posix=False)
        if not tokens:
            raise TemplateError(f"{where}: empty command in {{{{ {expr} }}}}")
        name, args = tokens[0], [term(t, dot, root, where) for t in tokens[1:]]
        if not first:
            args.append(value)
        if name in FUNCTIONS:
            try:
                value = FUNCTIONS[name](*args)
            except TypeError as error:
                raise TemplateError(f"{where}: {name} in {{{{ {expr} }}}}: {error}")
        elif len(tokens) == 1 and first:
            value = term(name, dot, root, where)
        else:
            raise TemplateError(f"{where}: unknown function {name!r} in {{{{ {expr} }}}}")
        first = False
    return value


def format_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        raise TemplateError(f"a map or list printed without toYaml: {value!r}")
    return str(value)


def execute(nodes, dot, root, where):
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif node[0] == "expr":
            out.append(format_value(evaluate(node[1], dot, root, where)))
        else:
            value = evaluate(node[1], dot, root, where)
            if truthy(value):
                out.append(execute(node[2], value if node[0] == "with" else dot, root, where))
            else:
                out.append(execute(node[3], dot, root, where))
    return "".join(out)


def merge(base, override):
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def render(chart_dir, value_files=(), release="sched-relay", namespace="sched-relay"):
    chart_dir = pathlib.Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())
    for extra in value_files:
        merge(values, yaml.safe_load(pathlib.Path(extra).read_text()) or {})
    root = {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    }
    documents = []
    for template in sorted((chart_dir / "templates").glob("*.yaml")):
        where = str(template)
        text = execute(parse(template.read_text(), where), root, root, where)
        documents.append(f"---\n# Source: {template.relative_to(chart_dir)}\n{text}")
    return "\n".join(documents)


if __name__ == "__main__":
    try:
        print(render(sys.argv[1], sys.argv[2:]))
    except TemplateError as error:
        print(f"render-chart: {error}", file=sys.stderr)
        sys.exit(1)
