"""Pure parts of the text benchmarks (benchmarks/text_peers.py, benchmarks/text_servers.py): no peer environment,
no server, no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import text_peers


@pytest.mark.parametrize(("preset", "written"), [("avx2", "onnx/model_quint8_avx2.onnx"), ("avx512_vnni", "onnx/model_qint8_avx512_vnni.onnx"),
                                                 ("avx512", "onnx/model_qint8_avx512.onnx"), ("arm64", "onnx/model_qint8_arm64.onnx")])
def test_st_int8_file_is_what_st_wrote(tmp_path: Path, preset: str, written: str) -> None:
    """ST's avx2 preset writes model_quint8_avx2.onnx (unsigned weights): expecting qint8 never measured it."""
    st_dir = tmp_path / "st-model"
    (st_dir / "onnx").mkdir(parents=True)
    (st_dir / "onnx" / "model.onnx").write_bytes(b"")
    assert text_peers.st_files(st_dir, preset)["st-onnx-int8"] == written  # named before the export, from the preset
    (st_dir / written).write_bytes(b"")
    if preset == "avx512":  # the avx512 preset must not take avx512_vnni's file (or the reverse)
        (st_dir / "onnx" / "model_qint8_avx512_vnni.onnx").write_bytes(b"")
    assert text_peers.st_files(st_dir, preset)["st-onnx-int8"] == written
    assert (st_dir / text_peers.st_files(st_dir, preset)["st-onnx-int8"]).exists()


def test_st_int8_file_found_under_another_weight_type(tmp_path: Path) -> None:
    """Whatever weight type a later Optimum gives the preset, the file ST wrote is the one used."""
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model_qint8_avx2.onnx").write_bytes(b"")
    assert text_peers.st_int8_file(tmp_path, "avx2") == "onnx/model_qint8_avx2.onnx"
    (tmp_path / "onnx" / "model_quint8_avx2.onnx").write_bytes(b"")
    with pytest.raises(RuntimeError, match="several dynamic INT8 files"):
        text_peers.st_int8_file(tmp_path, "avx2")
