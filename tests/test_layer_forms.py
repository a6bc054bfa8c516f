"""The layer forms families declare (`models.layer_form.LayerForm`): invariants over every architecture, and the newer
forms' parameters (MLP and LayerNorm biases, unscaled LayerNorms, GPT-NeoX's fused attention, Apertus' 0-d scalars)
laid out over a 2 x 2 (fsdp, tensor) mesh with one device's forward, gradients and cache path."""
import pytest

from areal_jax.models.config import ARCHITECTURES
from areal_jax.models.layer_form import LayerForm


class _Form(LayerForm):
    def __init__(self, architecture: str):
        self.architecture = architecture


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architectures_form_is_consistent(arch):
    form = _Form(arch)
    assert form.mlp_activation in ("silu", "gelu_tanh", "gelu", "relu2", "xielu")
    assert (form.mlp_activation == "silu") <= form.gated_mlp  # (a SiLU MLP is gated; the ungated ones are not SiLU)
    assert not form.norm_bias or form.layer_norm  # (only LayerNorms have biases)
    assert not form.parallel_mlp_norm or form.parallel_block
    assert not (form.parallel_block and (form.sandwich_norms or form.olmo))  # (one residual add: no norms after)
    assert not (form.norm_offset and form.layer_norm) or form.norm_bias  # (1 + w: RMSNorms', LayerNorm1P's with a bias)
    assert not form.sandwich_norms or not form.olmo


@pytest.mark.long  # 6 forms x 5-8 s; their single-device paths are each family's own tests
@pytest.mark.parametrize("arch", ["gpt_neox", "apertus", "starcoder2", "olmo", "cohere2", "phi"])
def test_the_newer_forms_sharded_equal_one_device(arch):
    import jax

    from areal_jax.testing.models import assert_sharded_forward_matches_one_device, tiny_config

    assert_sharded_forward_matches_one_device(tiny_config(arch, num_layers=2), jax.make_mesh((2, 2), ("fsdp", "tensor")))
