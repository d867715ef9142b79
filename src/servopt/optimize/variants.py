"""The variants of one run: the model family's catalogue (``Family.catalogue``), chosen by default or by name.

A variant is data (``families.catalogue.Variant``); this module adds what needs
the registries: its identity for the result cache (pass parameters with their
defaults filled in) and the device its runtime computes on.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import asdict

from servopt.cpu import CpuFeatures
from servopt.errors import UserError
from servopt.families.base import family_of
from servopt.families.catalogue import CatalogueContext, Variant
from servopt.machine import Device, cpu_features, cpu_model, library_versions, usable_cores
from servopt.models.sources import LoadedModel
from servopt.runtimes.base import get_runtime

__all__ = ["Variant", "catalogue", "device_of", "is_linear_heavy", "machine_signature", "measured_with", "select", "variant_key"]


def catalogue(model: LoadedModel, *, linear_heavy: bool, accuracy_drop: float = 1.0, cpu: CpuFeatures | None = None,
              deploy_without_vnni: bool = False) -> list[Variant]:
    """Every variant servopt knows for this model, from its family (torch ones only for torch sources). Which run by
    default follows the CPU's features (``cpu``: bf16, fp16 and 8-bit dot-product arithmetic), each exclusion with
    its reason; ``deploy_without_vnni``: a target's CPU has no 8-bit dot products, and the weights are built for it."""
    family = family_of(model.spec)
    ctx = CatalogueContext(spec=model.spec, is_torch=model.is_torch, linear_heavy=linear_heavy,
                           cpu=cpu or CpuFeatures(frozenset()), accuracy_drop=accuracy_drop,
                           deploy_without_vnni=deploy_without_vnni, exporter=family.exporter)
    variants = family.catalogue(ctx)
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"the {model.spec.family_name} catalogue names a variant twice: {sorted(n for n in names if names.count(n) > 1)}")
    if sum(v.is_original for v in variants) != 1 or sum(v.is_baseline for v in variants) != 1:
        raise ValueError(f"the {model.spec.family_name} catalogue must mark exactly one original and one baseline variant")
    return variants


def original_of(variants: list[Variant]) -> Variant:
    """The variant every other is verified against: the model as it was given."""
    return next(v for v in variants if v.is_original)


def baseline_of(variants: list[Variant]) -> Variant:
    """The variant every same-run ratio is taken against (ONNX Runtime's defaults)."""
    return next(v for v in variants if v.is_baseline)


def device_of(v: Variant) -> Device:
    """Where a variant computes: its runtime says."""
    return get_runtime(v.runtime).device


def machine_signature() -> str:
    """The machine a figure is taken on, as far as it shapes the figure: the CPU model, the richest rung of the
    instruction-set ladder its flags reach (one model name comes with and without AVX-512 from one hypervisor to the
    next), and the cores this process may use."""
    return f"{cpu_model()} | {cpu_features().level} | {usable_cores()} cores"


def measured_with(runtime: str) -> dict[str, str]:
    """The libraries whose versions shape a runtime's figures: its own and the base ones (``machine.library_versions``),
    or, for a runtime that lives in an environment of its own, that environment's key (its spec and Python)."""
    own = get_runtime(runtime).environment()
    if own is not None:
        return {"environment": f"{own.name}-{own.key()}"}
    return library_versions(get_runtime(runtime).libraries)


def variant_key(v: Variant, source_hash: str, protocol: dict, data_hash: str, build_data: str | None = None,
                measured_on: str | None = None) -> str:
    """Identity of a measurement: same key → same result, so a rerun skips it. Pass parameters enter with their
    defaults filled in, so a changed default invalidates the old measurement; ``build_data`` (the calibration and
    tuning data's key, where a pass of the chain reads them) so a variant built on other data is measured again;
    ``measured_on`` (the machine's signature and the runtime's library versions: ``machine_signature``,
    ``measured_with``) so a rerun on another host or after a library upgrade measures again instead of mixing old
    figures with new ones in one decision."""
    from servopt.passes.base import validate_params

    chain = [(name, validate_params(name, params).model_dump()) for name, params in v.chain]
    identity = {k: val for k, val in asdict(v).items()
                if k not in ("default", "description", "left_out_why", "gate", "role", "refines", "same_kernels")}
    parts = [{**identity, "chain": chain, "needs_gpu": device_of(v) is Device.GPU}, source_hash, protocol, data_hash]
    extra = ([build_data] if build_data is not None else []) + ([measured_on] if measured_on is not None else [])
    body = json.dumps(parts + extra, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def left_out_reason(v: Variant) -> str:
    return v.left_out


def select(variants: list[Variant], patterns: list[str] | None, include_all: bool) -> list[Variant]:
    """Default variants, or those matching ``--variants`` names/globs/groups."""
    if not patterns:
        return [v for v in variants if v.default or include_all]
    chosen = [v for v in variants if any(fnmatch.fnmatch(v.name, p) or v.group == p for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatch(v.name, p) or v.group == p for v in variants)]
    if unknown:
        raise UserError(f"no variant matches {', '.join(unknown)}", fix=f"known variants: {', '.join(v.name for v in variants)}")
    return chosen


def is_linear_heavy(onnx_path: str | None) -> bool:
    """True when MatMul/Gemm dominate the graph (transformers): dynamic INT8 then pays off."""
    if onnx_path is None:
        return False
    import onnx

    ops = [n.op_type for n in onnx.load(onnx_path, load_external_data=False).graph.node]
    dense, conv = sum(o in ("MatMul", "Gemm") for o in ops), sum(o.startswith("Conv") for o in ops)
    return dense > conv
