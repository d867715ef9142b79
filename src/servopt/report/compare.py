"""The report's "Against the tools you would use instead" section, from ``compare.json`` (a ``Comparison``): reads
only that contract, renders Markdown and HTML, and is spliced into the run's reports by ``report.write_reports``."""

from __future__ import annotations

from html import escape
from pathlib import Path

from servopt.optimize.rundir import RunDir
from servopt.peers.contracts import Comparison, PeerRatio, PeerResult

TITLE = "Against the tools you would use instead"


def columns(c: Comparison) -> dict[str, str]:
    """The figures the peers' ratios have, in the order the runner measured the scenarios, each with its scenario's own
    label (``Scenario.label``, carried in each ``PeerRatio``): a new scenario is one file, and its column comes with
    it. A compare.json written before ratios carried labels reads them from the registered scenario."""
    out: dict[str, str] = {}
    for r in (r for p in c.peers for r in p.ratios):
        out.setdefault(r.metric, r.label or _registered_label(r.scenario) or r.metric)
    return out


def _registered_label(scenario: str) -> str:
    from servopt.peers.scenario import SCENARIOS

    return SCENARIOS.get(scenario).label if scenario in SCENARIOS.names() else ""


def load_comparison(out: Path) -> Comparison | None:
    path = RunDir(out).compare
    return Comparison.model_validate_json(path.read_text()) if path.exists() else None


def verdict(r: PeerRatio) -> str:
    """Which side the interval puts ahead: the peer ÷ pick ratio's interval clear of 1, else within the noise."""
    peer_worse = r.low > 1 if r.better == "lower" else r.high < 1
    peer_better = r.high < 1 if r.better == "lower" else r.low > 1
    if peer_worse:
        return "servopt's pick ahead"
    if peer_better:
        return "the peer ahead"
    return "within the noise"


def ratio_text(r: PeerRatio | None) -> str:
    if r is None:
        return "—"
    return f"{r.ratio:.2f}× ({r.low:.2f}–{r.high:.2f}): {verdict(r)}"


def _row(p: PeerResult, metrics: dict[str, str]) -> list[str]:
    if p.status != "ok":
        return [p.name, f"{p.status}: {p.why or ''}", *(["—"] * (1 + len(metrics)))]
    by = {r.metric: r for r in p.ratios}
    return [p.name, p.description, p.quality_text or "—", *(ratio_text(by.get(m)) for m in metrics)]


def _intro(c: Comparison) -> str:
    conf = sorted({f"{r.confidence:.0%}" for p in c.peers for r in p.ratios})
    noisy = (f" Rounds where some process saw other processes use the CPU: {', '.join(str(i + 1) for i in c.noisy_rounds)}."
             if c.noisy_rounds else "")
    return (f"servopt's pick for {c.target}, {c.pick} ({c.pick_quality_text or 'quality not judged'}"
            f"{'; ' + c.pick_note if c.pick_note else ''}), and each tool's own "
            f"answer for the same model and data, every one measured in a fresh process per round, {c.rounds} rounds, the "
            f"order flipped each round. A ratio is the peer's figure ÷ the pick's in the same round (median over rounds; "
            f"in brackets the median's distribution-free interval, coverage {', '.join(conf) or '—'}); p50 below 1 and "
            f"throughput above 1 favour the peer.{noisy}" + (" A --quick smoke run: not figures to decide on." if c.quick else ""))


def markdown(c: Comparison) -> str:
    metrics = columns(c)
    head = ["peer", "what it ran", "quality", *metrics.values()]
    lines = [f"## {TITLE}", "", _intro(c), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in _row(p, metrics)) + " |" for p in c.peers]
    return "\n".join(lines) + "\n"


def html(c: Comparison) -> str:
    metrics = columns(c)
    head = ["peer", "what it ran", "quality", *metrics.values()]
    rows = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in _row(p, metrics)) + "</tr>" for p in c.peers)
    return (f"<h2>{TITLE}</h2><p>{escape(_intro(c))}</p><table><tr>"
            + "".join(f"<th>{escape(h)}</th>" for h in head) + f"</tr>{rows}</table>\n")


def with_markdown(report: str, out: Path) -> str:
    """The Markdown report with the comparison section at its end (unchanged when the run has no compare.json)."""
    c = load_comparison(out)
    return report if c is None else report.rstrip("\n") + "\n\n" + markdown(c)


def with_html(report: str, out: Path) -> str:
    """The HTML report with the comparison section before its Data section (or its end)."""
    c = load_comparison(out)
    if c is None:
        return report
    anchor = "<h2>Data</h2>" if "<h2>Data</h2>" in report else "</body>"
    return report.replace(anchor, html(c) + anchor, 1)
