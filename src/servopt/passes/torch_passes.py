"""PyTorch passes. Eager, channels_last and torch.compile are runtime options (see
``runtimes/torch_runtime``); dynamic INT8 is a pass so its size on disk is real."""

from __future__ import annotations

from pathlib import Path

from servopt.contracts import Artifact
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass


@register_pass
class TorchQuantizeDynamic(Pass):
    """``torch.ao.quantization.quantize_dynamic`` of Linear layers; saved to measure its size on disk."""

    name = "torch-quantize-dynamic"
    reads_data = False
    input_format = "torch"
    output_format = "torch"
    int8_recipe = True

    @classmethod
    def describe(cls, params: PassParams, report: dict | None = None) -> str:
        return "dynamic (activation ranges at run time)"

    def run(self, artifact: Artifact, params: PassParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import torch

        from servopt.models.sources import LoadedModel

        module = LoadedModel.from_ref(artifact.ref).torch_module()
        quantized = torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
        torch.save(quantized.state_dict(), out_dir / "quantized_state_dict.pt")
        # The runtime applies the same quantization on load (option quantize_dynamic) to the source reference.
        return PassOutput(format="torch", size_file="quantized_state_dict.pt")
