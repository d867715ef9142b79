"""Terminal tables (rich) for results, shared by every command."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from servopt.contracts import Record


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def flags(r: Record) -> str:
    out = []
    if r.interference and r.interference.flagged:
        out.append("⚠ noisy")
    session = r.environment.session if r.environment else None
    if session and session.provider_fallback:
        out.append(f"⚠ ran on {session.provider_actual}")
    if session and session.precision_actual:
        out.append(session.precision_actual)
    return " ".join(out)


def results_table(results: list[Record], title: str = "servopt bench", family=None) -> Table:
    from servopt.families.image import format_accuracy

    describe = family.describe_quality if family is not None else (lambda r: format_accuracy(getattr(r.quality, "accuracy", None)))
    t = Table(title=title, title_style="bold")
    for col in ("model", "runtime", "size MB", "quality", "agree", "p50 ms", "p95 ms", "p99 ms",
                "1-sample /s", "batch /s", "cold s", "RSS MB", "notes"):
        t.add_column(col, justify="left" if col in ("model", "runtime", "quality", "notes") else "right")
    for r in results:
        if r.status != "ok":
            t.add_row(escape(r.name), r.runtime, *["—"] * 10, f"[red]{r.status}: {escape(str(r.error))}[/red]")
            continue
        lat, tp = r.latency_ms, r.throughput_ips
        agr = getattr(r.quality, "agreement", None)
        agree = agr.top1_agreement if agr and agr.top1_agreement is not None else (agr.cosine_mean if agr else None)
        t.add_row(
            escape(r.name), r.runtime, _f(r.size_mb), describe(r), _f(agree * 100 if agree is not None else None, "{:.1f}%"),
            _f(lat.p50 if lat else None), _f(lat.p95 if lat else None), _f(lat.p99 if lat else None),
            _f(tp.single if tp else None, "{:.0f}"), _f(tp.batch if tp else None, "{:.0f}") + f" (×{r.batch_size})",
            _f(r.cold_start_s), _f(r.peak_rss_mb, "{:.0f}"), flags(r),
        )
    return t


def print_results(results: list[Record], title: str = "servopt bench", console: Console | None = None, family=None) -> None:
    (console or wide_console()).print(results_table(results, title, family))


def wide_console() -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=200)
