"""How the report writes a figure, a record's name, the precision that ran and a machine: shared by every section of
the report (``report.py`` assembles them) and by its charts, so a variant is called the same in every table."""

from __future__ import annotations

from servopt.contracts import Environment, Record
from servopt.cpu import CpuFeatures


def figure(v: float | None, fmt: str = "{:.2f}") -> str:
    """A number as a table shows it; an em dash where nothing was measured."""
    return "—" if v is None else fmt.format(v)


def label(r: Record) -> str:
    """A record's name in tables and charts: the variant, and the kind of node it was measured for (distributed)."""
    return f"{r.name} [{r.measured_for}]" if r.measured_for else r.name


def precision_of(r: Record) -> str:
    """The precision the runtime said it ran (read back from the session), not the one asked for."""
    session = r.environment.session if r.environment else None
    if session is None or session.precision_actual is None:
        return "—"
    return session.precision_actual


def machine_of(env: Environment | None) -> str:
    """The machine of a measurement in one line: CPU, cores, instruction-set features, GPU."""
    if env is None:
        return "an unrecorded machine"
    gpu = f", GPU {env.gpu_name}" if env.gpu_name else ", no GPU"
    return f"{env.cpu} ({env.cores} cores; {CpuFeatures(frozenset(env.cpu_flags)).describe()}{gpu})"
