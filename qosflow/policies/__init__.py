"""Scheduling policies, one module each, behind one interface (`Policy.schedule`).

Baselines: fifo, sjf, srtf, tiresias, sjf-ffs, sjf-bsbf, genie, gavel (heterogeneity-aware max-min
fairness over GPU models, `qosflow.policies.gavel`). qosflow's own policy registers as
`qosflow` (module `qosflow.policies.qosflow_policy`). Packing policies for fractional-GPU
requests (first-fit, best-fit, fgd) live in `qosflow.packing`.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from qosflow.errors import UnknownNameError
from qosflow.policies.base import Decision, Policy, SchedulerView, commit

#: policy name -> module defining it (imported on first use)
BUILTIN = {
    "fifo": "qosflow.policies.fifo",
    "sjf": "qosflow.policies.sjf",
    "srtf": "qosflow.policies.srtf",
    "tiresias": "qosflow.policies.tiresias",
    "sjf-ffs": "qosflow.policies.sjf_ffs",
    "sjf-bsbf": "qosflow.policies.sjf_bsbf",
    "genie": "qosflow.policies.genie",
    "gavel": "qosflow.policies.gavel",
    "qosflow": "qosflow.policies.qosflow_policy",
}

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    names = set(_REGISTRY)
    for name, mod in BUILTIN.items():
        if importlib.util.find_spec(mod) is not None:
            names.add(name)
    return sorted(names)


def get_policy(name: str, **options: Any) -> Policy:
    return policy_class(name)(**options)


def policy_class(name: str) -> type[Policy]:
    """The class registered as `name`, its module imported on first use (unknown names fail with the
    list of known ones)."""
    key = name.strip().lower()
    if key not in _REGISTRY and key in BUILTIN:
        try:
            importlib.import_module(BUILTIN[key])
        except ModuleNotFoundError as exc:
            if exc.name != BUILTIN[key]:
                raise
    if key not in _REGISTRY:
        raise UnknownNameError("policy", name, available())
    return _REGISTRY[key]


def is_builtin(name: str) -> bool:
    """Is `name` one of qosflow's own policies (not one registered over it at run time), so that a
    fresh interpreter finds the same class under that name?"""
    key = name.strip().lower()
    return key in BUILTIN and policy_class(key).__module__.startswith(BUILTIN[key])


def parse_policies(spec: str) -> list[str]:
    """`"fifo, QoSflow"` -> `["fifo", "qosflow"]` (`qosflow simulate --policies`): names only, each known.

    An empty list, or an item with options written into it (`qosflow:foo=1`, `qosflow(foo=1)`), fails
    naming --policies and saying what to give instead (they said "unknown policy ''" / "'qosflow:foo=1'")."""
    from qosflow.errors import SpecError

    given = [s.strip() for s in spec.split(",") if s.strip()]
    if not given:
        raise SpecError("--policies", "give at least one policy name, e.g. --policies fifo,qosflow")
    known = available()
    for item in given:
        base = item.split(":")[0].split("=")[0].split("(")[0].strip() or "POLICY"
        if base != item and item.lower() not in known:
            raise SpecError("--policies", f"{item!r}: --policies takes policy names only; give a policy's options "
                                          f"with --set {base}.OPTION=VALUE (repeatable), e.g. --set qosflow.express_share=0.125")
    names = [s.lower() for s in given]
    for n in names:
        if n not in BUILTIN and n not in _REGISTRY:
            raise UnknownNameError("policy", n, available())
    return names


_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def parse_policy_options(items: list[str] | None, names: list[str]) -> dict[str, dict[str, Any]]:
    """`["qosflow.express_share=0.125", ...]` -> `{"qosflow": {"express_share": 0.125}}`.

    Values are read as JSON (numbers, true/false, null, quoted strings) or as Python's True/False/None,
    else kept as text. Each
    option is checked against the policy's constructor, so a typo fails here naming the option and
    the ones the policy has, and so is its value's type (`align=False` or `qos_weight=abc` fail here).
    An option set twice is an error naming both values (the last one won silently)."""
    import json

    from qosflow.errors import SpecError

    out: dict[str, dict[str, Any]] = {}
    given: dict[tuple[str, str], str] = {}  # (policy, option) -> the value as written
    for item in items or []:
        key, sep, raw = item.partition("=")
        pol, dot, opt = key.strip().partition(".")
        pol = pol.lower()
        if not sep or not dot or not opt:
            raise SpecError("--set", f"{item!r}: write POLICY.OPTION=VALUE, e.g. qosflow.express_share=0.125")
        if pol not in names:
            raise SpecError("--set", f"{item!r}: policy {pol!r} is not among --policies ({', '.join(names)})")
        try:
            value = json.loads(raw)
        except ValueError:
            # Python's spelling, as docs/policies.md writes options (`align=True`): was refused as a text
            value = _PYTHON_WORDS.get(raw.strip(), raw.strip())  # (' any' was kept, and refused as 'any')
        problem = option_problem(pol, opt, value, shown=repr(raw.strip()))
        if problem is not None:
            raise SpecError("--set", f"{item!r}: {problem}")
        if (pol, opt) in given:  # the last one won without a word
            raise SpecError("--set", f"{pol}.{opt} is set twice, to {given[pol, opt]!r} and to {raw.strip()!r}: "
                                     "give each option once")
        given[pol, opt] = raw.strip()
        out.setdefault(pol, {})[opt] = value
    for pol, opts in out.items():
        try:
            get_policy(pol, **opts)
        except (TypeError, ValueError) as exc:
            raise SpecError("--set", f"policy {pol!r}: {exc}") from exc
    return out


def option_problem(policy: str, opt: str, value: Any, *, shown: str | None = None) -> str | None:
    """What is wrong with option `opt`=`value` of `policy` (None: nothing): an option the policy does
    not have, or a value not of the type its constructor declares (`shown`: how to show the value).
    Unknown policy names raise `UnknownNameError` with the known ones. Used by `simulate --set` and
    the QoS policy block. Reads the policy's class only: the policy is not made (its constructor's own
    checks run where the caller makes it, once, with all the options)."""
    import inspect

    cls = policy_class(policy)  # unknown names fail with the list of known ones
    params = inspect.signature(cls.__init__).parameters
    known = sorted(n for n, p in params.items() if n != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    if opt not in known:
        return f"policy {policy!r} has no option {opt!r}; it has: {', '.join(known) or 'none'}"
    wants = _option_kind(cls, opt, value)
    if wants is not None:
        return f"option {opt!r} of policy {policy!r} takes {wants}, got {shown if shown is not None else repr(value)}"
    return None


def _option_kind(cls: type, opt: str, value: Any) -> str | None:
    """None when `value` (as read from `--set`) fits the type the policy's constructor declares for
    `opt`, else what the option takes: a text such as "maybe" or "False" is truthy and would turn a
    true/false option on, and a text for a number failed mid-run with a traceback. A text option with
    a fixed set of names (`Literal`, or `Policy.option_choices`) takes one of them, and says which."""
    import typing

    try:
        hint = typing.get_type_hints(cls.__init__).get(opt)
    except Exception:  # an annotation that does not resolve: leave the check to the policy
        return None
    if hint is None:
        return None
    kinds = [a for a in (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,))]
    number = (int, float)
    ok = {
        bool: lambda v: isinstance(v, bool),
        float: lambda v: isinstance(v, number) and not isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        type(None): lambda v: v is None,
    }
    said = {bool: "true or false", float: "a number", int: "a whole number", str: "a name", type(None): "null"}
    wants = []
    for k in kinds:
        if typing.get_origin(k) is typing.Literal:
            if value in typing.get_args(k):
                return None
            wants.append("one of " + ", ".join(str(a) for a in typing.get_args(k)))
        elif typing.get_origin(k) in (tuple, list):
            if isinstance(value, list) and all(ok[float](v) for v in value):
                return None
            wants.append("a list of numbers, e.g. [3250, 7200]")
        elif k is str and getattr(cls, "option_choices", {}).get(opt):
            names = tuple(cls.option_choices[opt])
            if value in names:
                return None
            wants.append("one of " + ", ".join(names))  # "takes a name" did not say which
        elif k in ok:
            if ok[k](value):
                return None
            wants.append(said[k])
        else:  # a type --set cannot check
            return None
    return " or ".join(wants) if wants else None


__all__ = ["Decision", "Policy", "SchedulerView", "available", "commit", "get_policy", "option_problem", "parse_policies", "policy_class",
           "parse_policy_options", "register"]
