"""The zoo must match torchvision's architectures: same parameter names, same parameter counts."""

import pytest
import torch

from servopt.errors import UserError
from servopt.models.zoo import build

# Parameter counts published in torchvision's model documentation (1000 classes).
TORCHVISION_PARAMS = {"mobilenet_v2": 3_504_872, "resnet18": 11_689_512, "resnet50": 25_557_032}


@pytest.mark.parametrize("arch", list(TORCHVISION_PARAMS))
def test_parameter_count_matches_torchvision(arch):
    model = build(arch, 1000)
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS[arch]


def test_mobilenet_v2_parameter_names_match_torchvision():
    keys = set(build("mobilenet_v2", 11).state_dict())
    for key in [
        "features.0.0.weight", "features.0.1.running_var", "features.1.conv.0.0.weight", "features.1.conv.1.weight",
        "features.1.conv.2.num_batches_tracked", "features.2.conv.0.0.weight", "features.2.conv.1.0.weight",
        "features.2.conv.2.weight", "features.2.conv.3.bias", "features.18.0.weight", "features.18.1.bias",
        "classifier.1.weight", "classifier.1.bias",
    ]:
        assert key in keys, key
    assert len(keys) == 314  # torchvision's mobilenet_v2 state_dict has 314 entries


def test_resnet50_parameter_names_match_torchvision():
    keys = set(build("resnet50", 11).state_dict())
    for key in ["conv1.weight", "bn1.running_mean", "layer1.0.downsample.0.weight", "layer1.0.downsample.1.weight",
                "layer4.2.conv3.weight", "layer4.2.bn3.num_batches_tracked", "fc.weight", "fc.bias"]:
        assert key in keys, key
    assert len(keys) == 320


def test_zoo_forward_shapes():
    with torch.inference_mode():
        assert build("mobilenet_v2", 11)(torch.zeros(2, 3, 64, 64)).shape == (2, 11)
        assert build("resnet18", 5).eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 5)


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(UserError, match="unknown architecture"):
        build("vgg99", 10)
