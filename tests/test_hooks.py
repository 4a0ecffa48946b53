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


class _Recorder:
    """A streamer (transformers' BaseStreamer interface): what ``put`` and ``end`` received."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_generate_still_keeps_the_streamer_from_a_callable_custom_generate():
    """transformers hands a callable custom_generate no streamer (generate_streamer reads it from generate's
    frame). When this fails on the first assert, transformers passes it on: drop hooks.generate_streamer."""
    model = tiny_model("gpt2").eval()
    ids = torch.tensor([[1, 2, 3]])
    rec, seen = _Recorder(), {}

    def probe(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen["kwargs"], seen["hook"] = dict(kwargs), hooks.generate_streamer()
        return input_ids

    assert torch.equal(model.generate(ids, max_new_tokens=2, streamer=rec, custom_generate=probe), ids)
    assert "streamer" not in seen["kwargs"], "transformers now passes the streamer: drop generate_streamer"
    assert seen["hook"] is rec
    assert rec.puts == [[1, 2, 3]]  # generate put the prompt in it, and nothing else
    model.generate(ids, max_new_tokens=2, custom_generate=probe)
    assert seen["hook"] is None  # no streamer given
    assert hooks.generate_streamer() is None  # not inside generate


def test_generate_still_runs_its_own_loops_where_own_generate_loop_finds_them():
    from transformers import GenerationConfig
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin, GenerationMode

    for mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        assert GENERATION_MODES_MAPPING[mode] == "_sample"
    for mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
        assert GENERATION_MODES_MAPPING[mode] == "_beam_search"
    first = ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus"]
    assert list(inspect.signature(GenerationMixin._sample).parameters)[:7] == [*first, "streamer"]
    assert list(inspect.signature(GenerationMixin._beam_search).parameters)[:6] == first
    model = tiny_model("llama").eval()
    assert hooks.own_generate_loop(model, GenerationConfig(prompt_lookup_num_tokens=3)) is None  # assisted
    ids = torch.tensor([[5, 9, 2, 7]])

    def handing_back(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        loop = hooks.own_generate_loop(model, generation_config)
        streamer = hooks.generate_streamer()
        return loop(
            input_ids, logits_processor, stopping_criteria, generation_config, False, streamer, **kwargs
        )

    for options in ({"do_sample": False}, {"num_beams": 2, "do_sample": False}):
        want = model.generate(ids, max_new_tokens=5, eos_token_id=None, **options)
        rec = _Recorder()
        got = model.generate(
            ids, max_new_tokens=5, eos_token_id=None, streamer=rec, custom_generate=handing_back, **options
        )
        assert torch.equal(got, want), options
        if "num_beams" not in options:  # the sample loop streams: the prompt, then each new token
            assert rec.puts == [ids[0].tolist(), *[[t] for t in want[0, 4:].tolist()]] and rec.ended


def test_torch_still_counts_in_place_changes_in_the_tensor_version():
    w = torch.nn.Parameter(torch.ones(3, 2))
    v = hooks.tensor_version(w)
    _ = w.detach().sum(), w.t().contiguous()
    assert hooks.tensor_version(w) == v  # reads leave it
    with torch.no_grad():
        w.mul_(2)
    assert hooks.tensor_version(w) > v
    v = hooks.tensor_version(w)
    w.detach().add_(1)  # a detached view shares the counter
    assert hooks.tensor_version(w) > v


def test_torch_still_runs_callbacks_queued_from_a_hook_when_the_backward_ends_in_order():
    w = torch.nn.Parameter(torch.ones(3))
    seen: list[str] = []
    w.register_hook(lambda g: hooks.queue_after_backward(lambda: seen.append(f"first {w.grad}")))
    w.register_hook(lambda g: hooks.queue_after_backward(lambda: seen.append("second")))
    (w * 2).sum().backward()
    assert seen == [f"first {torch.full((3,), 2.0)}", "second"]  # after .grad is written, in queue order


def _row(seed: int = 0, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, generator=g, dtype=torch.float64).float() * 3


def test_transformers_processors_still_hold_and_compute_what_the_native_sampling_call_reimplements():
    """The fields logits_processor_fields reads are the constructor's arguments, and each processor still
    computes its definition (written out here in float64), which sample.c computes from those fields."""
    from transformers.generation import logits_process as lp

    ids = torch.tensor([[3, 7, 3, 11]])
    x = _row()
    p64 = torch.softmax(x[0].double(), -1)
    inf = -float("inf")

    proc = lp.RepetitionPenaltyLogitsProcessor(penalty=1.3, prompt_ignore_length=1)
    kind, f = hooks.logits_processor_fields(proc)
    assert kind == "repetition_penalty" and f == {
        "penalty": 1.3,
        "prompt_ignore_length": 1,
        "logits_indices": None,
    }
    want = x[0].double().clone()
    for t in {7, 3, 11}:  # the ids after the first prompt_ignore_length
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    assert torch.allclose(proc(ids, x.clone())[0].double(), want, atol=1e-6)

    proc = lp.TemperatureLogitsWarper(0.7)
    assert hooks.logits_processor_fields(proc) == ("temperature", {"temperature": 0.7})
    assert torch.allclose(proc(ids, x.clone())[0].double(), x[0].double() / 0.7, atol=1e-6)

    proc = lp.TopKLogitsWarper(top_k=3, min_tokens_to_keep=5)
    assert hooks.logits_processor_fields(proc) == ("top_k", {"top_k": 5, "filter_value": inf})
    out = proc(ids, x.clone())[0]
    keep = set(torch.argsort(x[0], descending=True)[:5].tolist())
    assert {i for i in range(40) if out[i] > inf} == keep and all(out[i] == x[0, i] for i in keep)

    order = torch.argsort(p64, descending=True).tolist()
    for top_p in (0.3, 0.8):
        proc = lp.TopPLogitsWarper(top_p, min_tokens_to_keep=2)
        kind, f = hooks.logits_processor_fields(proc)
        assert kind == "top_p" and f == {"top_p": top_p, "min_tokens_to_keep": 2, "filter_value": inf}
        # the most probable tokens until their mass reaches top_p, at least min_tokens_to_keep of them
        keep, mass = set(), 0.0
        for i in order:
            if mass >= top_p and len(keep) >= 2:
                break
            keep.add(i)
            mass += float(p64[i])
        out = proc(ids, x.clone())[0]
        assert {i for i in range(40) if out[i] > inf} == keep, top_p

    proc = lp.MinPLogitsWarper(0.1, min_tokens_to_keep=1)
    kind, f = hooks.logits_processor_fields(proc)
    assert kind == "min_p" and f == {"min_p": 0.1, "min_tokens_to_keep": 1, "filter_value": inf}
    out = proc(ids, x.clone())[0]
    assert {i for i in range(40) if out[i] > inf} == {i for i in range(40) if p64[i] >= 0.1 * p64.max()}

    class Derived(lp.TopKLogitsWarper):  # a subclass may compute something else: not read
        pass

    assert hooks.logits_processor_fields(Derived(3)) is None
    assert hooks.logits_processor_fields(lp.NoRepeatNGramLogitsProcessor(2)) is None


def test_transformers_stopping_criteria_still_hold_what_the_native_loop_decides_on():
    from transformers.generation import stopping_criteria as sc

    from hf_sparsity.inference.loop import eos_ids

    assert hooks.stopping_criterion_fields(sc.MaxLengthCriteria(7, max_position_embeddings=9)) == (
        "max_length",
        {"max_length": 7, "max_position_embeddings": 9},
    )
    kind, f = hooks.stopping_criterion_fields(sc.EosTokenCriteria([2, 5]))
    assert kind == "eos" and eos_ids(f["eos_token_id"]) == {2, 5}
    assert hooks.stopping_criterion_fields(sc.MaxTimeCriteria(1.0)) is None
    ids = torch.tensor([[1, 2, 3, 5]])
    assert sc.EosTokenCriteria([2, 5])(ids, None).tolist() == [True]  # what it decides: the last token
    assert sc.MaxLengthCriteria(4)(ids, None).tolist() == [True] and sc.MaxLengthCriteria(5)(
        ids, None
    ).tolist() == [False]


def test_torch_still_numbers_each_backward_pass_where_hooks_read_it():
    w = torch.nn.Parameter(torch.ones(3))
    ids: list[int] = []
    w.register_hook(lambda g: ids.append(hooks.backward_task_id()))
    w.register_hook(lambda g: ids.append(hooks.backward_task_id()))
    (w * 2).sum().backward()
    (w * 3).sum().backward()
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]  # one id per backward, two backwards
    assert hooks.backward_task_id() == -1  # outside any backward


def test_torch_still_has_the_cusparselt_ops_with_the_arguments_hooks_pass():
    """The ATen ops behind torch's semi-structured tensor, with the keywords cslt_search / cslt_mm pass
    (their results need a CUDA GPU: tests/test_cusparselt.py)."""
    assert hooks.cslt_ops_missing() is None
    schema = {name: str(getattr(torch.ops.aten, name).default._schema) for name in hooks.CSLT_OPS}
    assert schema["_cslt_compress"].startswith("aten::_cslt_compress(Tensor input)")
    assert "bool transpose_result=False" in schema["_cslt_sparse_mm_search"]
    assert schema["_cslt_sparse_mm_search"].endswith("-> int")
    assert (
        "bool transpose_result=False" in schema["_cslt_sparse_mm"]
        and "int alg_id=0" in schema["_cslt_sparse_mm"]
    )
