"""0.2's forms of the layer's options (the router as a name or a dict; the router's, shared experts', token
rounding's and expert parallelism's options as keyword arguments), mapped to the configs with a DeprecationWarning
that names the new form; they go in 0.3.

Memory: none.
"""
from __future__ import annotations

import dataclasses
import warnings

from .layer import DEFAULT_CAPACITY_FACTOR, ROUTERS, EPConfig, RoundingConfig, RouterConfig, SharedConfig

# 0.2's layer options as keyword arguments (MoELayer, ModelConfig) and the config each now belongs to.
LEGACY_LAYER = {"scoring": "router", "renormalize": "router", "shared_experts": "shared", "d_shared": "shared",
                "shared_gate": "shared", "token_rounding": "rounding", "rounding_tile": "rounding",
                "rounding_max_experts": "rounding"}


def layer_from_legacy(where: str, router, shared, rounding, legacy: dict, stacklevel: int = 3):
    """(router, shared, rounding) of a call: the configs (None: unset; the router's default then), or 0.2's forms
    (the router as a family's name or a dict, its options and the shared experts' and rounding's as keyword
    arguments; 0 and "" unset) with a DeprecationWarning that names the new form. TypeError for an unknown keyword,
    a config of another type or both forms at once."""
    unknown = sorted(set(legacy) - set(LEGACY_LAYER))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}")
    given = {k: v for k, v in legacy.items()
             if v is not None and (k == "renormalize" or not (v is False or v == "" or v == 0))}
    family = router if isinstance(router, str) else None
    old = sorted(given) + (["router"] if isinstance(router, (str, dict)) else [])
    if isinstance(router, str):
        router = RouterConfig.family(router)
    elif isinstance(router, dict):  # a dict of options: the ones beside it add to it, and never contradict it
        flat = {k: given.pop(k) for k in _keys("router") if k in given}
        _same(flat, router)
        router = RouterConfig(**{**router, **flat})
    router = _one_form(where, "router", router, RouterConfig, given)
    shared = _one_form(where, "shared", shared, SharedConfig, given)
    rounding = _one_form(where, "rounding", rounding, RoundingConfig, given)
    if old:
        new = [f"router=moeblaze.RouterConfig.family({family!r})" if family and router == ROUTERS[family] else
               f"router={shown(router)}" if router not in (None, RouterConfig()) else ""]
        new += [f"{k}={shown(v)}" for k, v in (("shared", shared), ("rounding", rounding)) if v is not None]
        warnings.warn(f"{where}({', '.join(old)}=...) is deprecated and goes in 0.3: pass "
                      f"{', '.join(n for n in new if n) or 'nothing (the defaults)'}", DeprecationWarning,
                      stacklevel=stacklevel)
    return router or RouterConfig(), shared, rounding


def config_from_legacy(where: str, name: str, value, kind: type, legacy: dict, unset: dict | None = None,
                       stacklevel: int = 3):
    """The `kind` config a call passes as `name`: `value` (None: unset, returned as None), or 0.2's form, its fields
    as keyword arguments `legacy` (None, and a value equal to the one `unset` gives it, unset), with a
    DeprecationWarning that names the new form. TypeError for an unknown keyword, another type or both forms."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a moeblaze.{kind.__name__} or None, got {type(value).__name__}")
    if not legacy:  # the common call, traced by torch.compile under expert parallelism: nothing more to look at
        return value
    unknown = sorted(set(legacy) - {f.name for f in dataclasses.fields(kind)})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}")
    if value is not None:
        raise TypeError(f"{where}(): pass {name}={kind.__name__}(...) only, not also {sorted(legacy)}")
    unset = unset or {}
    new = kind(**{k: v for k, v in legacy.items() if v is not None and (k not in unset or v != unset[k])})
    warnings.warn(f"{where}({', '.join(sorted(legacy))}=...) is deprecated and goes in 0.3: pass "
                  f"{name}={shown(new)}", DeprecationWarning, stacklevel=stacklevel + 1)
    return new


def ep_from_legacy(where: str, ep_config, legacy: dict, stacklevel: int = 3):
    """The EPConfig of a call: `ep_config` (None: the default, exact dispatch), or 0.2's form (dispatch,
    capacity_factor, capacity, on_overflow as keyword arguments; their defaults 1.25 and "error" unset)."""
    old = {"dispatch": "exact", "capacity_factor": DEFAULT_CAPACITY_FACTOR, "on_overflow": "error"}
    return (config_from_legacy(where, "ep_config", ep_config, EPConfig, legacy, old, stacklevel)
            or EPConfig())


def shown(config) -> str:
    """A config as the call that makes it: moeblaze.Name(field=value, ...) with the fields that differ from their
    defaults."""
    changed = ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                        if f.init and getattr(config, f.name) != f.default)
    return f"moeblaze.{type(config).__name__}({changed})"


def _keys(name: str) -> tuple:
    """0.2's keyword arguments that the `name` config now holds."""
    return tuple(k for k, config in LEGACY_LAYER.items() if config == name)


def _same(flat: dict, options: dict) -> None:
    """ValueError where a router option given beside a router contradicts the router's own."""
    for k, v in flat.items():
        if k in options and options[k] != v:
            raise ValueError(f"{k}={v!r} contradicts the router's {k}={options[k]!r}: give it once")


def _one_form(where: str, name: str, value, kind: type, given: dict):
    """The `name` config of a call from `value` or from its 0.2 keyword arguments in `given`."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a moeblaze.{kind.__name__} or None, got {type(value).__name__}")
    flat = {k: given[k] for k in _keys(name) if k in given}
    if not flat:
        return value
    if kind is RouterConfig:  # options beside a router: they add to the default set, and never contradict one given
        if value is not None:
            _same(flat, dataclasses.asdict(value))
        return (value or RouterConfig()).replace(**flat)
    if value is not None:
        raise TypeError(f"{where}(): pass {name}={kind.__name__}(...) only, not also {sorted(flat)}")
    if kind is SharedConfig:
        return flat_shared(flat.get("shared_experts"), flat.get("d_shared"), flat.get("shared_gate"))
    return flat_rounding(flat.get("token_rounding"), flat.get("rounding_tile"), flat.get("rounding_max_experts"))


def flat_shared(shared_experts: int | None, d_shared: int | None, shared_gate: bool | None) -> SharedConfig | None:
    """The SharedConfig of flat options (0.2's keyword arguments, the command line's flags); 0, None or False: unset.
    ValueError for a width or a gate without shared experts."""
    if not shared_experts:
        if d_shared or shared_gate:
            k, v = ("shared_gate", shared_gate) if shared_gate else ("d_shared", d_shared)
            raise ValueError(f"{k}={v!r} configures shared experts, but shared_experts is {shared_experts or 0}")
        return None
    return SharedConfig(shared_experts, d_shared or None, bool(shared_gate))


def flat_rounding(token_rounding: str | None, rounding_tile: int | None,
                  rounding_max_experts: int | None = None) -> RoundingConfig | None:
    """The RoundingConfig of flat options (0.2's keyword arguments, the command line's flags); None or "": unset.
    ValueError for a tile or a bound without a rule."""
    if not token_rounding:
        given = [f"{k}={v!r}" for k, v in (("rounding_tile", rounding_tile),
                                           ("rounding_max_experts", rounding_max_experts)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} configures token rounding, but token_rounding is unset")
        return None
    return RoundingConfig(token_rounding, rounding_tile or None, rounding_max_experts)
