"""The configuration reference, docs/configuration.md, rendered from the settings in kvfuse/config/.

Each setting's dotted key, environment variable, type with its bounds, default and description come from
its pydantic field, so the page says what the code does. Regenerate it after changing a setting:

    kvfuse config docs -o docs/configuration.md        # or: python -m kvfuse.config_docs -o ...

tests/test_config_docs.py fails while the committed page differs from what this renders.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvfuse.config import FusionRequestSettings, RetrievalRequestSettings, Settings

INTRO = """\
Every setting has a default here and in `config.yaml`. Sources, highest priority first: environment
variables, then the YAML file (`KVFUSE_CONFIG` names another file; else `config.yaml` in the working
directory; else the copy shipped beside the package). An environment variable is `KVFUSE_` and the
dotted key in upper case with `__` for each dot (`fusion.method` is `KVFUSE_FUSION__METHOD`); a list
is comma-separated items or a JSON list. A bad value stops startup with a message naming the key.
`kvfuse config show` prints the settings in effect."""

TOP_LEVEL = "Top level"


def env_var(path: tuple[str, ...]) -> str:
    cfg = Settings.model_config
    return cfg["env_prefix"] + cfg["env_nested_delimiter"].join(path).upper()


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def leaf_fields(model: type[BaseModel] = Settings, path: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    """Every setting as (key path, field), in declaration order, sections expanded."""
    for name, field in model.model_fields.items():
        sub = _section_model(field)
        if sub is None:
            yield (*path, name), field
        else:
            yield from leaf_fields(sub, (*path, name))


def _type_name(ann: typing.Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return ann.__name__ if isinstance(ann, type) else str(ann)


def _bounds(field: FieldInfo) -> str:
    """`1 ≤ x ≤ 65535`, `≥ 0`, `> 0` or `` from the field's ge/gt/le/lt."""
    b = {attr: getattr(m, attr) for m in field.metadata for attr in ("ge", "gt", "le", "lt") if hasattr(m, attr)}
    b = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in b.items()}
    lower = f"≥ {b['ge']}" if "ge" in b else f"> {b['gt']}" if "gt" in b else ""
    upper = f"≤ {b['le']}" if "le" in b else f"< {b['lt']}" if "lt" in b else ""
    if lower and upper:
        return f"{lower[2:]} {'≤' if 'ge' in b else '<'} x {upper}"
    return lower or upper


def type_text(field: FieldInfo) -> str:
    """The type, then its bounds: `int, 1 ≤ x ≤ 65535`, `float, > 0`, `str, non-empty`."""
    extra = [_bounds(field)] + ["non-empty" if m.min_length == 1 else f"length ≥ {m.min_length}"
                                for m in field.metadata if isinstance(m, at.MinLen)]
    return ", ".join([_type_name(field.annotation), *filter(None, extra)])


def default_text(field: FieldInfo) -> str:
    v = field.default
    if isinstance(v, str | Path):
        return str(v) if str(v) else '""'
    return json.dumps(v) if v is None or isinstance(v, bool | list) else repr(v)


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text.replace("<", "&lt;")


def _section_intro(model: type[BaseModel]) -> list[str]:
    doc = model.__dict__.get("__doc__")
    lines = [" ".join(inspect.cleandoc(doc).split())] if doc else []
    for base, obj in ((FusionRequestSettings, "fusion"), (RetrievalRequestSettings, "retrieval")):
        if issubclass(model, base):
            keys = ", ".join(f"`{k}`" for k in base.model_fields)
            lines.append(f"A query (`POST /v1/query`, `POST /v1/chat/completions`) may set {keys} in its "
                         f"`{obj}` object; the settings of those names here are its defaults.")
    return lines


def _table(rows: list[tuple[tuple[str, ...], FieldInfo]]) -> list[str]:
    out = ["| key | environment variable | type | default | description |", "|---|---|---|---|---|"]
    for path, field in rows:
        out.append(f"| `{'.'.join(path)}` | `{env_var(path)}` | {_cell(type_text(field))} "
                   f"| {_cell(default_text(field), code=True)} | {_cell(field.description or '')} |")
    return out


def render() -> str:
    """The whole page, ending with one newline."""
    top = [(path, f) for path, f in leaf_fields() if len(path) == 1]
    sections = [(name, sub) for name, f in Settings.model_fields.items() if (sub := _section_model(f))]
    parts = ["# Configuration", "",
             "<!-- Generated by `kvfuse config docs` from kvfuse/config/; do not edit by hand. -->", "",
             INTRO, "",
             "Sections: " + " · ".join(f"[{n}](#{n.lower().replace(' ', '-')})"
                                        for n in [TOP_LEVEL, *(n for n, _ in sections)]), "",
             f"## {TOP_LEVEL}", "", *_table(top), ""]
    for name, sub in sections:
        intro = _section_intro(sub)
        parts += [f"## {name}", "", *(p for line in intro for p in (line, "")),
                  *_table(list(leaf_fields(sub, (name,)))), ""]
    return "\n".join(parts)


def write(output: str | None) -> None:
    text = render()
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfuse.config_docs", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", help="write the page here (e.g. docs/configuration.md), not stdout")
    write(parser.parse_args(argv).output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
