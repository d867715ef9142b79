"""Terminal tables (rich) for results, shared by every command."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from servopt.bench.metrics import format_accuracy


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def flags(r: dict) -> str:
    out = []
    if (r.get("interference") or {}).get("flagged"):
        out.append("⚠ noisy")
    session = (r.get("environment") or {}).get("session") or {}
    if session.get("provider_fallback"):
        out.append(f"⚠ ran on {session.get('provider_actual')}")
    return " ".join(out)


def results_table(results: list[dict], title: str = "servopt bench") -> Table:
    t = Table(title=title, title_style="bold")
    for col in ("model", "runtime", "size MB", "accuracy (top-1)", "agree", "p50 ms", "p95 ms", "p99 ms",
                "1-sample /s", "batch /s", "cold s", "RSS MB", "notes"):
        t.add_column(col, justify="left" if col in ("model", "runtime", "accuracy (top-1)", "notes") else "right")
    for r in results:
        if r.get("status") != "ok":
            t.add_row(escape(r["name"]), r.get("runtime", ""), *["—"] * 10, f"[red]{r.get('status')}: {escape(str(r.get('error')))}[/red]")
            continue
        lat, tp = r.get("latency_ms") or {}, r.get("throughput_ips") or {}
        agree = (r.get("agreement") or {}).get("top1_agreement")
        t.add_row(
            escape(r["name"]), r["runtime"], _f(r.get("size_mb")), format_accuracy(r.get("accuracy")),
            _f(agree * 100 if agree is not None else None, "{:.1f}%"),
            _f(lat.get("p50")), _f(lat.get("p95")), _f(lat.get("p99")), _f(tp.get("single"), "{:.0f}"),
            _f(tp.get("batch"), "{:.0f}") + f" (×{r.get('batch_size')})", _f(r.get("cold_start_s")),
            _f(r.get("peak_rss_mb"), "{:.0f}"), flags(r),
        )
    return t


def print_results(results: list[dict], title: str = "servopt bench", console: Console | None = None) -> None:
    (console or wide_console()).print(results_table(results, title))


def wide_console() -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=200)
