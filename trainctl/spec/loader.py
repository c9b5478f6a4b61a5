"""Load a run spec from YAML, apply `--set a.b=c` overrides, validate, and explain every mistake."""

from __future__ import annotations

import copy
import difflib
import math
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainctl.errors import SpecError
from trainctl.fileio import NotRegularFile, TooLarge, read_capped
from trainctl.spec import rules
from trainctl.spec.models import RunSpec

MAX_SPEC_BYTES = 1 << 20  # 1 MiB: a spec is a page of YAML; anything bigger is a mistake (or an attack)
# YAML nodes after alias expansion: a real spec has a few hundred. Aliases share one node when loaded, but
# validation and every dump expand them, so nested aliases ("billion laughs") blow up exponentially.
MAX_SPEC_NODES = 20_000
MAX_ECHO = 80  # characters of a user's key or value echoed in a message


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> RunSpec:
    """Read, override and validate the spec at `path`; raise SpecError (exit 2) on any problem."""
    return load_spec_text(read_spec_text(path), str(path), overrides)


def read_spec_text(path: str | Path) -> str:
    """The text of the YAML file at `path`: a regular file of at most MAX_SPEC_BYTES in UTF-8, else SpecError.
    What is not a regular file is refused before a byte is read (/dev/zero never ends, a FIFO never opens)."""
    source = str(path)
    try:
        raw = read_capped(Path(path), MAX_SPEC_BYTES)
    except FileNotFoundError:
        raise SpecError(["no such file. Fix: check the path (recipes/ has examples)"], source) from None
    except NotRegularFile as e:
        raise SpecError([f"is {e.kind}, not a spec file. Fix: pass the path of a .yaml file"], source) from None
    except TooLarge:
        raise SpecError([f"file is larger than {MAX_SPEC_BYTES // (1 << 20)} MiB ({MAX_SPEC_BYTES:,} bytes), the "
                         "most a spec may be. Fix: pass the run spec, not a data file"], source) from None
    except OSError as e:
        raise SpecError([f"cannot read the file ({e.strerror}). Fix: check the path and permissions"],
                        source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(["not UTF-8 text. Fix: pass a YAML run spec"], source) from None
    return text


def load_spec_text(text: str, source: str = "<spec>", overrides: Sequence[str] = ()) -> RunSpec:
    data = parse_yaml(text, source)
    data = apply_overrides(data, overrides, source)
    return validate_spec(data, source)


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """A user's key or value as echoed in a message: cut to a readable length."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def _expanded_nodes(root: yaml.Node) -> int | None:
    """Nodes the document has once every alias is expanded (memoised per shared node, so linear in the
    file); None for a recursive alias."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int | None:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            return None
        active.add(key)
        total = 1
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        for child in children:
            n = size(child)
            if n is None:
                return None
            total += n
            if total > MAX_SPEC_NODES:
                break  # over the bound already: no need to count the rest
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


class DuplicateKey(Exception):
    """A mapping that gives one key twice: PyYAML would keep the last silently (a second `train:` section
    replacing the first whole)."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(f"key {key!r} at lines {first.line + 1} and {again.line + 1}")
        self.key, self.first, self.again = key, first, again

    def line(self) -> str:
        a, b = self.first, self.again
        where = (f"line {a.line + 1} and at line {b.line + 1}" if a.line != b.line else
                 f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}")
        return (f"key {clip(repr(self.key))} is given twice in one mapping, at {where}; YAML would keep only the "
                "second. Fix: keep one (merge the two)")


class _RefuseDuplicateKeys:
    """A SafeConstructor that raises DuplicateKey where a mapping names a key twice. The keys written in the
    mapping are compared; those a merge key (`<<: *base`) brings in may be overridden, as YAML means them to.
    Checked at a node's first flattening, the one place that sees every mapping as written: flattening puts
    the merged keys into the node, and a merge source may be flattened (by a mapping merging it) before it is
    constructed."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        checked: set[int] = self.__dict__.setdefault("_checked_mappings", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)  # type: ignore[attr-defined]
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # an unhashable key: the constructor refuses it itself
                if first is not key_node.start_mark:
                    raise DuplicateKey(key, first, key_node.start_mark)
        super().flatten_mapping(node)  # type: ignore[misc]


# libyaml's parser where PyYAML was built with it: the same documents, parsed about 10x faster
class _FastLoader(_RefuseDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    pass


class _Loader(_RefuseDuplicateKeys, yaml.SafeLoader):
    pass


def safe_load(text: str) -> Any:
    """yaml.safe_load that refuses a key given twice in one mapping (DuplicateKey): every YAML a user gives
    trainctl (a spec, a `--set` value) is read by it."""
    try:
        return _construct(_FastLoader, text)
    except yaml.YAMLError:
        # not valid YAML: PyYAML's own parser finds the same place and names the character (a tab, say)
        return _construct(_Loader, text)


def _construct(loader_class: type, text: str) -> Any:
    loader = loader_class(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _safe_load_bounded(text: str, source: str) -> Any:
    """`safe_load`, refusing documents whose alias expansion would exceed MAX_SPEC_NODES."""
    try:
        return _load_bounded(text, source, _FastLoader)
    except yaml.YAMLError:
        return _load_bounded(text, source, _Loader)


def _load_bounded(text: str, source: str, loader_class: type) -> Any:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded_nodes(node)
        if n is None:
            raise SpecError(["a YAML alias refers to itself. Fix: write plain values instead of recursive "
                             "anchors"], source)
        if n > MAX_SPEC_NODES:
            raise SpecError([f"the YAML expands to more than {MAX_SPEC_NODES:,} values once its aliases "
                             "(*name) are expanded; a run spec has a few hundred. Fix: write plain values"],
                            source)
        try:
            return loader.construct_document(node)
        except DuplicateKey as e:
            raise SpecError([e.line()], source) from None
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = _safe_load_bounded(text, source)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([f"not valid YAML{where}: {what}. Fix: check indentation and quoting"], source) from None
    except (ValueError, RecursionError, OverflowError) as e:  # pathological scalars or nesting
        raise SpecError([f"not a usable YAML spec ({type(e).__name__}). Fix: write a plain mapping"],
                        source) from None
    if data is None:
        raise SpecError(["the spec is empty. Fix: start from a recipe in recipes/"], source)
    if not isinstance(data, dict):
        raise SpecError([f"the top level is a {type(data).__name__}, not a mapping of sections. "
                         "Fix: write `name:`, `model:`, `parallel:`, `train:` ... at the top level"], source)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as a YAML scalar/flow value)."""
    key, sep, value = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError([f"--set {clip(repr(item))}: expected KEY.PATH=VALUE, e.g. --set parallel.tp=4"])
    try:
        parsed = safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML: keep the raw string (e.g. a path with a colon)
    except DuplicateKey as e:
        raise SpecError([f"--set {clip(repr(item))}: {e.line()}"]) from None
    return key.split("."), parsed


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], source: str = "<spec>") -> dict[str, Any]:
    data = dict(data)
    for item in overrides:
        keys, value = parse_override(item)
        node: dict[str, Any] = data
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                where = ".".join(keys[: i + 1])
                raise SpecError([f"--set {clip(repr(item))}: {clip(where)} is a {type(child).__name__}, not a "
                                 "section"], source)
            node[key] = child = dict(child)
            node = child
        alternatives = ALTERNATIVES.get(tuple(keys[:-1]), ())
        if keys[-1] in alternatives and value:
            # `--set data.synthetic=true` on a recipe with a data.path means "this source instead", and
            # `--set train.tokens=2T` on one with train.steps "this length instead"
            for other in alternatives:
                node.pop(other, None)
        node[keys[-1]] = value
    return data


# The keys of the data section that each name the run's whole data source (the spec allows one).
DATA_SOURCES = ("path", "blend", "synthetic")
# Per section, keys that each say the same thing another way: a `--set` of one replaces the others.
ALTERNATIVES = {("data",): DATA_SOURCES, ("train",): ("steps", "tokens")}


def validate_spec(data: dict[str, Any], source: str = "<spec>") -> RunSpec:
    """The validated spec, or a SpecError with every independent problem at once: pydantic stops a section's
    own checks, and the cross-section rules cannot run, while any field is invalid, so each pass sets the
    invalid fields aside (their defaults stand in) and validates again, and the rules then judge the rest."""
    lines: list[str] = []
    removed: list[tuple[str | int, ...]] = []
    defaulted: list[tuple[str | int, ...]] = []  # set aside with a default standing in (not an unknown key)
    for _ in range(MAX_VALIDATION_PASSES):
        try:
            spec = RunSpec.model_validate(data)
        except ValidationError as e:
            # an error at a field set aside is that field's own (a required one now missing): said already
            fresh = [err for err in e.errors(include_url=False) if tuple(err["loc"]) not in removed]
            # a section's own check that names a field set aside judged its stand-in, not what the user wrote
            judged = [err for err in fresh if not _mentions_any(err["msg"], defaulted)]
            lines += [line for line in _explain_errors(judged) if line not in lines]
            locs = [tuple(err["loc"]) for err in fresh]
            data = _without(data, locs)
            if not fresh:
                break
            removed += locs
            defaulted += [tuple(err["loc"]) for err in fresh if err["type"] != "extra_forbidden"]
            continue
        except (RecursionError, OverflowError, MemoryError) as e:
            raise SpecError([f"spec could not be validated ({type(e).__name__}). Fix: simplify the values"],
                            source) from None
        found = rules.check(spec, tp_unsettled=("parallel", "tp") in defaulted)
        not_checked = list(found.not_checked)
        for line in found.problems:
            if not _mentions_any(line, defaulted):
                lines.append(line)
            elif (note := _not_checked(line, defaulted)) not in not_checked:
                not_checked.append(note)
        if lines:
            raise SpecError(lines, source, not_checked)
        return spec
    raise SpecError(lines, source)


def _not_checked(rule_line: str, locs: list[tuple[str | int, ...]]) -> str:
    """What a rule that judged a stand-in for an invalid field says instead: which field it could not check."""
    field = rules.field_of(rule_line)
    invalid = ", ".join(".".join(str(x) for x in loc) for loc in locs if loc and _mentions_any(rule_line, [loc]))
    return f"{field}: not checked: its rule needs {invalid}, which is invalid (see above)"


MAX_VALIDATION_PASSES = 8  # each pass sets aside a deeper layer of errors; a spec has few layers of sections


def _mentions_any(rule_line: str, locs: list[tuple[str | int, ...]]) -> bool:
    """Whether a rule's line names a field set aside (`tp` in `tp*pp*dp = 1*2*2`, `data` in `data.path`): it
    judged the default standing in for it, not what the user wrote, so it is no independent error."""
    return any(re.search(rf"(?<!\w){re.escape(str(loc[-1]))}(?!\w)", rule_line) for loc in locs if loc)


def _without(data: Any, locs: list[tuple[str | int, ...]]) -> Any:
    """`data` without the values at `locs` (each cut at the deepest key it names that exists: a union's
    member name or a list index past the end is not a key of the data)."""
    data = copy.deepcopy(data)
    for loc in reversed(locs):  # the last first: removing a list item leaves the earlier indices as they were
        parent, key = None, None
        node = data
        for part in loc:
            in_dict = isinstance(node, dict) and part in node
            in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
            if in_dict or in_list:
                parent, key, node = node, part, node[part]
            else:
                break
        if parent is not None:
            del parent[key]
    return data


def _explain_errors(errors: list[Any]) -> list[str]:
    lines = []
    for err in errors:
        loc = [str(x) for x in err["loc"]]
        field = clip(".".join(loc)) or "(top level)"
        value = err.get("input")
        kind = err["type"]
        if kind == "extra_forbidden":
            lines.append(f"{field}: unknown key. Fix: {_suggest(loc)}")
        elif kind == "missing":
            lines.append(f"{field}: required but missing. Fix: add `{loc[-1]}:` to the "
                         f"{'.'.join(loc[:-1]) or 'top level'} section")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            lines.append(f"{field} = {_short(value)}: {msg}. Fix: {_fix_for(kind, err)}")
    return lines


def _short(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return clip(repr(value), 60)


# Fields where null is meaningful: the fix for a bad value says so.
NULL_MEANS = {"train.grad_clip": "null turns clipping off", "train.watchdog_s": "null turns the watchdog off",
              "train.min_lr": "null means lr/10"}


def _fix_for(kind: str, err: Any) -> str:
    fix = _bound_fix(kind, err)
    note = NULL_MEANS.get(".".join(str(x) for x in err["loc"]))
    return f"{fix} ({note})" if note else fix


def _bound_fix(kind: str, err: Any) -> str:
    ctx = err.get("ctx") or {}
    bounds = {"less_than_equal": ("<=", "le"), "less_than": ("<", "lt"),
              "greater_than_equal": (">=", "ge"), "greater_than": (">", "gt")}
    if kind in bounds:
        op, key = bounds[kind]
        return f"use a value {op} {ctx.get(key)}"
    if kind.startswith(("int_", "float_", "bool_", "string_", "list_", "dict_", "model_")):
        return "give a value of the type shown (see `trainctl schema`)"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected')}"
    return "see `trainctl schema` for the allowed values"


def _suggest(loc: list[str]) -> str:
    """Name the closest valid key, walking the models along the location."""
    model: type[BaseModel] | None = RunSpec
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list of sections (data.blend.0): the same model
            continue
        field = model.model_fields.get(part) if model else None
        model = _section_model(field.annotation) if field else None
    if model is None:
        return "remove it"
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1][:MAX_ECHO], names, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return f"remove it; valid keys here: {', '.join(names)}"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section's annotation, through `X | None` and `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in typing.get_args(annotation) if (m := _section_model(arg)) is not None), None)


def resolved_dict(spec: RunSpec) -> dict[str, Any]:
    """The spec with every default and `auto` filled in, as frozen into a run directory."""
    data = spec.model_dump(mode="json", by_alias=True)
    data["parallel"]["dp"] = spec.dp
    data["launcher"]["backend"] = spec.backend
    return data


def frozen_text(spec: RunSpec) -> str:
    """The text of a run directory's spec.yaml for `spec` (resolved_dict as YAML): written by the launch, and
    kept in every checkpoint to rebuild it from."""
    return yaml.safe_dump(resolved_dict(spec), sort_keys=False)
