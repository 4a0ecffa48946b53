"""The reaches into torch, transformers, DeepSpeed and peft internals (``hf_sparsity.hooks``): each test
fails by name when a release moves what the hook relies on. The Trainer save / resume hooks are tested
in ``test_checkpoints.py``."""

from __future__ import annotations

import inspect

import pytest
import torch

from hf_sparsity import hooks

from .conftest import tiny_model


def test_torch_schedulers_still_offer_a_closed_form_lr_and_last_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert hooks.closed_form_lr(sched, 5) == [0.25]  # 1.0 · 0.5^(5 // 2)
    assert sched.last_epoch == 5
    hooks.set_last_lr(sched, [0.125])
    assert sched.get_last_lr() == [0.125]
    assert hooks.closed_form_lr(object(), 3) is None


def test_torch_still_has_the_dtensor_local_shape_and_offset_function():
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"]


def test_peft_lora_linear_still_routes_forward_and_merge_through_lora_variant():
    peft = pytest.importorskip("peft")
    from peft.tuners.lora.layer import LoraVariant

    calls = []

    class Recording(LoraVariant):
        @staticmethod
        def forward(module, active_adapter, x, result, **kwargs):
            calls.append("forward")
            return result + 1

        @staticmethod
        def merge_safe(module, active_adapter, orig_weight):
            calls.append("merge_safe")
            return orig_weight + 1

        @staticmethod
        def merge_unsafe(module, active_adapter, orig_weight):
            calls.append("merge_unsafe")
            orig_weight.data += 1

        @staticmethod
        def unmerge(module, active_adapter, orig_weight):
            calls.append("unmerge")
            return orig_weight.data - 1

    cfg = peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama"), cfg)
    layer = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    hooks.set_lora_variant(layer, "default", Recording())
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.base_layer(x) + 1)
        w = layer.base_layer.weight.detach().clone()
        layer.merge(safe_merge=True)
        torch.testing.assert_close(layer.base_layer.weight, w + 1)
        layer.unmerge()
        layer.merge(safe_merge=False)
        layer.unmerge()
        torch.testing.assert_close(layer.base_layer.weight, w)
    assert calls == ["forward", "merge_safe", "unmerge", "merge_unsafe", "unmerge"]
    hooks.drop_lora_variant(layer, "default")
    assert "default" not in layer.lora_variant


def test_trainer_still_calls_its_callbacks_from_the_list_hooks_change_in_place():
    from transformers import ProgressCallback, TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler

    seen = []

    class Probe(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            seen.append("probe")

    handler = CallbackHandler([ProgressCallback()], None, None, None, None)

    class FakeTrainer:
        callback_handler = handler

    hooks.trainer_callbacks(FakeTrainer()).insert(0, Probe())  # in place, ahead of the printer
    handler.on_log(None, TrainerState(), TrainerControl(), logs={})
    assert seen == ["probe"]
    old = handler.callbacks[1]
    assert {"training_bar", "prediction_bar"} <= set(vars(old))  # the printer's state that must carry over
    new = hooks.carry_callback_state(old, ProgressCallback())
    assert vars(new) == vars(old)


def test_transformers_generate_still_compiles_on_cpu_through_the_compile_config_switch():
    import transformers.generation.utils as generation
    from transformers import CompileConfig

    cc = CompileConfig()
    assert hooks.compile_generate_on_any_device(cc) is cc and cc._compile_all_devices is True
    assert "compile_config._compile_all_devices" in inspect.getsource(generation)  # what generate reads


def test_transformers_still_caches_the_compiled_forward_where_hooks_drop_it():
    from transformers import CompileConfig, PreTrainedModel

    assert "self._compiled_call" in inspect.getsource(PreTrainedModel.get_compiled_call)
    model = tiny_model("gpt2")
    compiled = model.get_compiled_call(CompileConfig(dynamic=False, mode="default"))  # compiles on first call
    assert model.get_compiled_call(CompileConfig(dynamic=False, mode="default")) is compiled  # the cache
    hooks.forget_compiled_forward(model)
    assert "_compiled_call" not in vars(model)
    assert model.get_compiled_call(CompileConfig(dynamic=False, mode="default")) is not compiled


def test_deepspeed_still_links_parameters_where_hooks_read_them():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils import mixed_precision_linkage

    # ZeRO-1/2: every parameter gets its tensor-fragment link (None on a rank without a piece of it).
    assert f"lp_param.{hooks.ZERO12_LINK} = " in inspect.getsource(mixed_precision_linkage)
    # ZeRO-3: every parameter points to its optimizer.
    assert f"p.{hooks.ZERO3_OPTIMIZER} = self" in inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    p = torch.nn.Parameter(torch.zeros(2))
    assert not hooks.is_zero12_linked(p) and hooks.zero12_fragment(p) is None
    assert hooks.zero3_optimizer(p) is None
    setattr(p, hooks.ZERO12_LINK, None)  # what a rank whose partition holds none of it sees
    assert hooks.is_zero12_linked(p) and hooks.zero12_fragment(p) is None
