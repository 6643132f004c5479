"""Tools the policy can call in multi-turn rollouts: their definitions, the registry a run loads from
its config, and their argument checks.

A tool is a `Tool(name, description, parameters, fn, timeout_s=2.0, memory_mb=256, cpu_s=None)`:
`parameters` is a JSON schema object (`{"type": "object", "properties": {...}, "required": [...]}`)
and the runner calls `fn(**arguments)`; whatever `fn` returns becomes the observation text (a str as
is, anything else as JSON, or `str()` when it is not JSON). The limits of one call
(rlframe/agents/sandbox.py): `timeout_s` of wall-clock time, `memory_mb` of address space on top of
what the tool worker maps, and `cpu_s` seconds of CPU time per process of the call, all its threads
counted (None: timeout_s, one core's worth; raise it for a tool that computes on several threads).

`load_tools(path, builtin=("calculator",))` returns the built-in tools named plus those a user's
Python file defines (agent.tools_path, loaded like reward functions in rlframe/rewards/registry.py),
either as a list

    TOOLS = [Tool(name="lookup", description="...", parameters={...}, fn=lookup)]

or as functions decorated in the file

    from rlframe.agents.tools import tool

    @tool(name="lookup", description="Look a word up.",
          parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]})
    def lookup(word): ...

Everything is checked when the tools load, before any worker starts or any rollout runs: the file
exists and imports, it defines tools, names are unique and usable as function names, each schema is
an object schema over the basic JSON types whose required keys are among its properties, and each
`fn` is callable with the schema's properties as keyword arguments. Tools remember where they were
loaded from (`source`), so the runner's worker process loads them again from there: functions from a
file loaded this way do not pickle.

`tool_schemas(tools)` gives the OpenAI/Qwen-style function specs the chat template puts in the system
prompt; `check_arguments(tool, arguments)` checks a call's arguments against the schema.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlframe.agents import calculator as _calculator

BUILTIN_SOURCE = "builtin"
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOOL_ATTR = "__rlframe_tool__"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]
    timeout_s: float = 2.0
    memory_mb: int = 256
    cpu_s: float | None = None  # CPU seconds per process of one call (RLIMIT_CPU); None: timeout_s
    # Where load_tools found the tool: BUILTIN_SOURCE, or the path of the user's file. The runner's
    # worker process loads it again from there; None: the tool is sent to the worker pickled.
    source: str | None = field(default=None, compare=False, repr=False)


def tool(*, name: str | None = None, description: str | None = None, parameters: dict,
         timeout_s: float = 2.0, memory_mb: int = 256, cpu_s: float | None = None) -> Callable[[Callable], Callable]:
    """Decorator marking a function of a tools file as a tool; the function itself is returned
    unchanged (still callable directly). `name` defaults to the function's name and `description`
    to its docstring."""

    def mark(fn: Callable) -> Callable:
        doc = inspect.getdoc(fn) or ""
        spec = Tool(name=name if name is not None else getattr(fn, "__name__", ""),
                    description=description if description is not None else doc,
                    parameters=parameters, fn=fn, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s)
        try:
            setattr(fn, _TOOL_ATTR, spec)
        except (AttributeError, TypeError) as exc:
            raise TypeError(f"@tool can only decorate functions, not a {type(fn).__name__}") from exc
        return fn

    return mark


def _builtin_tools() -> dict[str, Tool]:
    return {
        "calculator": Tool(name="calculator", description=_calculator.DESCRIPTION, parameters=_calculator.PARAMETERS,
                           fn=_calculator.calculator, source=BUILTIN_SOURCE),
    }


BUILTIN_TOOLS: dict[str, Tool] = _builtin_tools()


def load_tools(path: str | Path | None, *, builtin: Sequence[str] = ("calculator",)) -> dict[str, Tool]:
    """The built-in tools named in `builtin` plus the tools of the Python file `path` (None: none),
    by name, in that order; ValueError (what, why, how to fix) for anything a run could not use."""
    if isinstance(builtin, str):
        builtin = (builtin,)
    tools: dict[str, Tool] = {}
    where: dict[str, str] = {}
    for name in builtin:
        if name not in BUILTIN_TOOLS:
            raise ValueError(f"there is no built-in tool {name!r} (built-in tools: {sorted(BUILTIN_TOOLS)}); "
                             "fix agent.builtin_tools")
        _add(tools, where, BUILTIN_TOOLS[name], "the built-in tools (agent.builtin_tools)")
    if path is not None:
        file = Path(path).expanduser()
        for t in _tools_of_file(file):
            _add(tools, where, t, f"{str(file)!r}")
    return tools


def check_tool_budget(tools: Mapping[str, Tool], max_tool_seconds: float) -> None:
    """ValueError when a tool may run longer (its timeout_s) than a trajectory's whole tool time
    (agent.max_tool_seconds_per_trajectory)."""
    slow = {t.name: t.timeout_s for t in tools.values() if t.timeout_s > max_tool_seconds}
    if slow:
        raise ValueError(f"tools {slow} may run longer (timeout_s) than a trajectory's whole tool time, "
                         f"agent.max_tool_seconds_per_trajectory={max_tool_seconds}; lower "
                         "their timeout_s or raise the budget")


def tool_schemas(tools: Mapping[str, Tool] | Iterable[Tool]) -> list[dict]:
    """The function specs of `tools` for the chat template:
    [{"type": "function", "function": {"name", "description", "parameters"}}, ...]."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description, "parameters": copy.deepcopy(t.parameters)}}
            for t in values]


def _add(tools: dict[str, Tool], where: dict[str, str], t: Tool, origin: str) -> None:
    if t.name in tools:
        raise ValueError(f"duplicate tool name {t.name!r}: defined by {where[t.name]} and by {origin}; tool names "
                         "must be unique (the policy calls tools by name): rename one, or drop the built-in from "
                         "agent.builtin_tools")
    check_tool(t, where=f"tool {t.name!r} from {origin}")
    tools[t.name] = t
    where[t.name] = origin


def _tools_of_file(file: Path) -> list[Tool]:
    if not file.is_file():
        raise ValueError(f"tools file {str(file)!r} does not exist (or is not a file); fix agent.tools_path "
                         "(relative paths are resolved from the working directory)")
    module = _import_file(file)
    found: list[Tool] = []
    if hasattr(module, "TOOLS"):
        listed = module.TOOLS
        if isinstance(listed, (str, bytes, Mapping)) or not isinstance(listed, Iterable):
            raise ValueError(f"TOOLS in tools file {str(file)!r} is a {type(listed).__name__}; it must be a list of "
                             "rlframe.agents.tools.Tool")
        for i, t in enumerate(listed):
            if not isinstance(t, Tool):
                raise ValueError(f"TOOLS[{i}] in tools file {str(file)!r} is a {type(t).__name__}, not a "
                                 "rlframe.agents.tools.Tool; build it with Tool(name=..., description=..., "
                                 "parameters=..., fn=...) or decorate the function with @tool(...)")
            found.append(t)
    seen = {id(t.fn) for t in found}
    for value in list(vars(module).values()):
        spec = getattr(value, _TOOL_ATTR, None) if callable(value) else None
        if isinstance(spec, Tool) and id(value) not in seen:
            seen.add(id(value))
            found.append(spec)
    if not found:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"tools file {str(file)!r} defines no tools (functions there: {public}); define "
                         "TOOLS = [Tool(...), ...] or decorate functions with @tool(name=..., description=..., "
                         "parameters=...) from rlframe.agents.tools")
    return [replace(t, source=str(file.resolve())) for t in found]


def _import_file(file: Path):
    resolved = str(file.resolve())
    module_name = f"rlframe_custom_tools_{hashlib.sha1(resolved.encode()).hexdigest()[:16]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"tools file {str(file)!r} cannot be imported as Python; agent.tools_path must name a .py file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before running it, so its dataclasses and pickling can find it
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ValueError(f"importing tools file {str(file)!r} failed: {exc!r}") from exc
    return module


def check_tool(t: Tool, *, where: str) -> None:
    """ValueError unless `t` is usable: a valid name, a text description, an object schema and a
    callable fn that accepts the schema's properties as keyword arguments."""
    if not isinstance(t.name, str) or not _NAME_RE.match(t.name):
        raise ValueError(f"{where}: the name {t.name!r} is not a valid tool name; use 1-64 letters, digits, "
                         "'_' or '-' (the name the policy writes in its calls)")
    if not isinstance(t.description, str):
        raise ValueError(f"{where}: description is a {type(t.description).__name__}, not a str")
    check_schema(t.parameters, where=where)
    if not callable(t.fn):
        raise ValueError(f"{where}: fn is a {type(t.fn).__name__}, not callable; set fn to the function the tool runs")
    if not _positive_number(t.timeout_s):
        raise ValueError(f"{where}: timeout_s must be a positive number of seconds, not {t.timeout_s!r}")
    if isinstance(t.memory_mb, bool) or not isinstance(t.memory_mb, int) or t.memory_mb <= 0:
        raise ValueError(f"{where}: memory_mb must be a positive int (MiB), not {t.memory_mb!r}")
    if t.cpu_s is not None and not _positive_number(t.cpu_s):
        raise ValueError(f"{where}: cpu_s must be a positive number of CPU seconds, or None for timeout_s; "
                         f"not {t.cpu_s!r}")
    try:
        sig = inspect.signature(t.fn)
    except (TypeError, ValueError):
        return  # some builtins have no readable signature; a mismatch then shows as an error result
    props = t.parameters.get("properties", {})
    try:
        sig.bind_partial(**{k: None for k in props})
    except TypeError as exc:
        raise ValueError(f"{where}: fn has signature {sig}, but the tool is called as fn(**arguments) with the "
                         f"schema's properties {sorted(props)}; rename the parameters to match ({exc})") from exc
    positional = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ValueError(f"{where}: fn has positional-only parameters {positional} (signature {sig}), but tools are "
                         "called as fn(**arguments); make them ordinary parameters")
    required = set(t.parameters.get("required", []))
    missing = [p.name for p in sig.parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in required]
    if missing:
        raise ValueError(f"{where}: fn requires the parameters {missing}, which the schema does not list under "
                         "\"required\"; add them there or give them defaults")


def cpu_seconds(t: Tool) -> float:
    """The CPU time one process of a call of `t` may use: its cpu_s, else its timeout_s."""
    return float(t.timeout_s if t.cpu_s is None else t.cpu_s)


def _positive_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_schema(schema: Any, *, where: str) -> None:
    """ValueError unless `schema` is a JSON object schema over the basic JSON types."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(f"{where}: parameters must be a JSON schema object "
                         '{"type": "object", "properties": {...}, "required": [...]}, '
                         f"got {_short(schema)}")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: parameters must be JSON (it goes into the prompt): {exc}") from exc
    _check_subschema(schema, path="parameters", where=where)


def _check_subschema(schema: Any, *, path: str, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: {path} must be a JSON schema (a dict), got {_short(schema)}")
    types = schema.get("type")
    if types is not None:
        for ty in types if isinstance(types, list) else [types]:
            if ty not in JSON_TYPES:
                raise ValueError(f"{where}: {path} has type {ty!r}; JSON schema types are {list(JSON_TYPES)}")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}: {path}.enum must be a list")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}: {path}.properties must be a dict of property name -> schema")
    for key, sub in props.items():
        _check_subschema(sub, path=f"{path}.properties.{key}", where=where)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}: {path}.required must be a list of property names")
    unknown = [r for r in required if r not in props]
    if unknown:
        raise ValueError(f"{where}: {path}.required names {unknown}, which are not in {path}.properties "
                         f"({sorted(props)}); add them to properties or remove them from required")
    if "items" in schema:
        _check_subschema(schema["items"], path=f"{path}.items", where=where)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        _check_subschema(extra, path=f"{path}.additionalProperties", where=where)


def check_arguments(t: Tool, arguments: Any) -> str | None:
    """Why `arguments` do not fit the tool's schema, or None when they do. Checked: an object,
    required keys present, no keys outside "properties" (the tool is called as fn(**arguments);
    allowed with "additionalProperties": true), the basic JSON types, "enum", and the same within
    nested objects and arrays (where extra keys are allowed unless "additionalProperties" is false)."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, not {_type_name(arguments)}"
    schema = t.parameters
    props = schema.get("properties", {})
    if schema.get("additionalProperties") in (None, False):
        extra = [k for k in arguments if k not in props]
        if extra:
            return f"unexpected argument {extra[0]!r} (arguments: {', '.join(props) or 'none'})"
    return _check_value(arguments, schema, "")


def _check_value(value: Any, schema: dict, path: str) -> str | None:
    label = f"argument {path!r}" if path else "arguments"
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        if not any(_is_type(value, ty) for ty in allowed):
            return f"{label} must be {' or '.join(_article(ty) for ty in allowed)}, not {_type_name(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{label} must be one of {schema['enum']}, not {_short(value)}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"missing required argument {_join(path, key)!r}"
        if schema.get("additionalProperties") is False:
            extra = [k for k in value if k not in props]
            if extra:
                return f"unexpected argument {_join(path, extra[0])!r}"
        for key, sub in value.items():
            sub_schema = props.get(key, schema.get("additionalProperties"))
            if isinstance(sub_schema, dict):
                err = _check_value(sub, sub_schema, _join(path, key))
                if err:
                    return err
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            err = _check_value(item, schema["items"], f"{path}[{i}]")
            if err:
                return err
    return None


def _is_type(value: Any, ty: str) -> bool:
    if ty == "string":
        return isinstance(value, str)
    if ty == "integer":  # JSON schema: a number with no fractional part (1.0 is an integer)
        return not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))
    if ty == "number":
        return not isinstance(value, bool) and isinstance(value, (int, float))
    if ty == "boolean":
        return isinstance(value, bool)
    if ty == "array":
        return isinstance(value, list)
    if ty == "object":
        return isinstance(value, dict)
    return value is None  # "null"


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if value is None:
        return "null"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def _article(ty: str) -> str:
    return "null" if ty == "null" else ("an " if ty[0] in "aeiou" else "a ") + ty


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
