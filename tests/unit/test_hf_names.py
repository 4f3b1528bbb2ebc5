"""The output names and slices alone (no files): wrapper prefixes, transformers' save-time
conversions, refusals, and the byte-range plan of a fused tensor's slices."""

from __future__ import annotations

import gc
import json
import math
import sys
import threading
from array import array

import numpy as np
import pytest
import torch

from shardstream.engine.memory import imports_collector_held
from shardstream.engine.plan import (
    Block,
    GlobalTensor,
    GridBlocks,
    dense_block,
    plan_copy,
    row_major_strides,
    slice_tensor,
)
from shardstream.errors import CheckpointFormatError, UsageError
from shardstream.formats import hf_names
from shardstream.formats.hf_names import plan_names, strip_wrappers


def test_wrapper_prefixes_are_stripped():
    names = ["_orig_mod.a.w", "_orig_mod.b._fsdp_wrapped_module._checkpoint_wrapped_module.w"]
    assert strip_wrappers(names) == {names[0]: "a.w", names[1]: "b.w"}
    assert strip_wrappers(["module.a", "module.b"]) == {"module.a": "a", "module.b": "b"}
    # torch.compile(DDP(model)) and DDP(torch.compile(model)): both wrappers go
    for names in (["_orig_mod.module.a", "_orig_mod.module.b"], ["module._orig_mod.a", "module.b"]):
        assert list(strip_wrappers(names).values()) == ["a", "b"]
    # DDP's prefix goes only when every name has it
    assert strip_wrappers(["module.a", "b"]) == {"module.a": "module.a", "b": "b"}


def test_two_names_that_become_one_are_refused_naming_both():
    with pytest.raises(CheckpointFormatError, match=r"'a\.w'.*'_orig_mod\.a\.w'.*'a\.w'"):
        strip_wrappers(["a.w", "_orig_mod.a.w"])


def test_no_model_type_keeps_the_stripped_names():
    plan = plan_names([("_orig_mod.x", "F32", (2,))], {})
    assert [(p.name, p.stored, p.whole) for p in plan.pieces] == [("x", "_orig_mod.x", True)]
    assert "no model type" in plan.rule


def test_keep_names_writes_the_stored_names():
    plan = plan_names([("_orig_mod.x", "F32", (2,))], {"model_type": "qwen3_moe"}, True)
    assert [p.name for p in plan.pieces] == ["_orig_mod.x"]
    assert plan.kept_names and "on purpose" in plan.describe()


def test_qwen3_moe_experts_are_boxes_of_the_fused_tensors(qwen3_moe_config):
    config = qwen3_moe_config
    e, i, h = 3, 6, 8
    stored = [
        ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (e, 2 * i, h)),
        ("model.layers.0.mlp.experts.down_proj", "BF16", (e, h, i)),
        ("model.layers.0.mlp.gate.weight", "BF16", (e, h)),
    ]
    plan = plan_names(stored, config)
    pieces = {p.name: p for p in plan.pieces}
    assert len(pieces) == 3 * e + 1
    prefix = "model.layers.0.mlp.experts"
    up = pieces[f"{prefix}.2.up_proj.weight"]
    assert (up.stored, up.start, up.extent, up.shape) == (
        f"{prefix}.gate_up_proj",
        (2, i, 0),
        (1, i, h),
        (i, h),
    )
    assert pieces[f"{prefix}.0.gate_proj.weight"].start == (0, 0, 0)
    down = pieces[f"{prefix}.1.down_proj.weight"]
    assert (down.start, down.extent, down.dims) == ((1, 0, 0), (1, h, i), (1, 2))
    assert pieces["model.layers.0.mlp.gate.weight"].whole
    assert "3 experts" not in plan.describe() and "2 fused tensors split into 9" in plan.describe()


def test_the_saved_per_expert_tensors_read_back_as_blocks_of_the_fused_ones(qwen3_moe_config):
    """``stored_view``: each saved output's bytes placed in its box of the stored tensor, so
    a restore reads the per-expert file tensors into the fused live one."""
    e, i, h = 3, 6, 8
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    stored = [(fused, "BF16", (e, 2 * i, h)), ("model.norm.weight", "BF16", (h,))]
    plan = plan_names(stored, qwen3_moe_config)
    saved, offset = {}, 0
    for piece in plan.pieces:  # each output one block in a file, one after the other
        shape = piece.shape
        block = Block("f", offset, "BF16", (0,) * len(shape), shape, row_major_strides(shape))
        saved[piece.name] = GlobalTensor(piece.name, "BF16", shape, (block,))
        offset += 2 * math.prod(shape)
    shapes = {name: shape for name, _, shape in stored}
    view = hf_names.stored_view(plan, saved, shapes)
    assert view.keys() == shapes.keys() and view[fused].shape == (e, 2 * i, h)
    starts = {b.offset: (b.start, b.shape, b.strides) for b in view[fused].blocks}
    up = saved["model.layers.0.mlp.experts.2.up_proj.weight"].blocks[0]
    assert starts[up.offset] == ((2, i, 0), (1, i, h), (0, h, 1))
    assert len(view[fused].blocks) == 2 * e  # a gate and an up half per expert
    gate = "model.layers.0.mlp.experts.0.gate_proj.weight"
    wide = Block("f", 0, "BF16", (0, 0), (2 * i, h), row_major_strides((2 * i, h)))
    wrong = dict(saved, **{gate: GlobalTensor(gate, "BF16", (2 * i, h), (wide,))})
    with pytest.raises(CheckpointFormatError, match=rf"'{gate}': shape \[12, 8\] in the saved"):
        hf_names.stored_view(plan, wrong, shapes)  # the gate half and the up half, in one
    del saved["model.layers.0.mlp.experts.1.gate_proj.weight"]  # one expert's half missing
    assert fused not in hf_names.stored_view(plan, saved, shapes)


def test_architectures_that_name_no_model_class_fall_back_to_the_auto_classes(
    qwen3_moe_config, monkeypatch
):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    stored = [("model.layers.0.mlp.experts.down_proj", "BF16", (3, 8, 6))]
    for named in (["pipeline"], ["AutoConfig"], ["__class__"], ["NoSuchForCausalLM"]):
        config = {**qwen3_moe_config, "architectures": named}
        plan = plan_names(stored, config)
        assert "Qwen3MoeForCausalLM" in plan.rule  # pipeline(config) was called before
        assert len(plan.pieces) == 3


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("architectures", [1], "'architectures' is \\[1\\], not a list of class names"),
        ("architectures", "Qwen3MoeForCausalLM", "'architectures' is Qwen3MoeForCausalLM, not"),
        ("model_type", ["qwen3_moe"], "'model_type' is \\['qwen3_moe'\\], not a model type"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_refused_naming_it(
    qwen3_moe_config, monkeypatch, field, value, message
):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    monkeypatch.setattr(hf_names, "_PLANS", {})
    config = {**qwen3_moe_config, field: value}
    with pytest.raises(CheckpointFormatError, match="config.json: " + message):
        plan_names([("model.norm.weight", "F32", (4,))], config)


def test_a_config_of_a_far_larger_model_than_the_checkpoint_is_refused_unbuilt(
    qwen3_moe_config, monkeypatch
):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    monkeypatch.setattr(hf_names, "_PLANS", {})
    config = {**qwen3_moe_config, "num_hidden_layers": 4000}  # 44,000 parameters
    stored = [("model.norm.weight", "F32", (8,))]
    with pytest.raises(CheckpointFormatError, match=r"registered over 4,104 parameters"):
        plan_names(stored, config)
    # the same config with the layers it names stored is built (the bound is per tensor)
    config["num_hidden_layers"] = 300
    stored = [(f"model.layers.{n}.input_layernorm.weight", "F32", (8,)) for n in range(3000)]
    assert "Qwen3MoeForCausalLM" in plan_names(stored, config).rule


@pytest.mark.parametrize("nested", [False, True])
def test_a_layer_count_above_the_stored_tensors_is_refused_before_the_config_is_built(
    qwen3_moe_config, monkeypatch, nested
):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    monkeypatch.setattr(hf_names, "_PLANS", {})
    config = dict(qwen3_moe_config)
    if nested:  # a VLM's text_config: its config class builds lists as long as this too
        config["text_config"] = {"num_hidden_layers": 10**8}
    else:
        config["num_hidden_layers"] = 10**8
    built = []
    monkeypatch.setattr(hf_names, "_model_class", lambda *a: built.append(a))
    stored = [(f"model.layers.{n}.input_layernorm.weight", "F32", (8,)) for n in range(3)]
    key = "text_config.num_hidden_layers" if nested else "num_hidden_layers"
    with pytest.raises(CheckpointFormatError, match=rf"larger model .*: {key} is 100,000,000,"):
        plan_names(stored, config)
    assert not built


def test_more_experts_than_the_tensors_could_hold_are_refused_before_the_model_is_built(
    qwen3_moe_config, monkeypatch
):
    """An 852-byte config.json claiming 10**5 experts beside a dense checkpoint: transformers'
    conversion named every expert of every layer (a gigabyte, growing with the count) before
    the mismatch was refused; inspect said the merge would take ~324 MiB."""
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    monkeypatch.setattr(hf_names, "_PLANS", {})
    built = []
    monkeypatch.setattr(hf_names, "_model_class", lambda *a: built.append(a))
    stored = [
        ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (3, 12, 8)),
        ("model.layers.0.mlp.experts.down_proj", "BF16", (3, 8, 6)),
    ]
    config = {**qwen3_moe_config, "num_experts": 10**5}
    with pytest.raises(CheckpointFormatError, match=r"larger model .*: num_experts is 100,000,"):
        plan_names(stored, config)
    assert not built


def test_a_config_transformers_rejects_is_refused_naming_config_json(qwen3_moe_config, monkeypatch):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    config = {**qwen3_moe_config, "hidden_size": "wide"}
    with pytest.raises(CheckpointFormatError, match=r"config.json: transformers' 'qwen3_moe'"):
        plan_names([("model.norm.weight", "F32", (8,))], config)


# config.json naming the backbone of the checkpoint's model: the auto class that holds it
@pytest.mark.parametrize("architecture", ["Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"])
def test_qwen2_5_vl_is_renamed(architecture):
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1},
        vision_config={"depth": 1, "hidden_size": 8, "num_heads": 2, "out_hidden_size": 8},
    ).to_dict()
    config["architectures"] = [architecture]
    with torch.device("meta"):
        held = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig(**config)
        ).state_dict()
    stored = [
        (name, "F32", tuple(held[name].shape))
        for name in (
            "model.language_model.layers.0.mlp.up_proj.weight",
            "model.visual.blocks.0.norm1.weight",
            "lm_head.weight",
        )
    ]
    names = {p.stored: p.name for p in plan_names(stored, config).pieces}
    assert names == {
        "model.language_model.layers.0.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight",
        "model.visual.blocks.0.norm1.weight": "visual.blocks.0.norm1.weight",
        "lm_head.weight": "lm_head.weight",
    }


@pytest.mark.parametrize("architectures", [["Qwen3MoeModel"], []])
def test_a_model_holding_none_of_the_tensors_is_refused(qwen3_moe_config, architectures):
    config = {**qwen3_moe_config, "architectures": architectures}
    stored = [("decoder.blocks.0.ffn.experts.gate_up_proj", "F32", (4, 16, 8))]
    with pytest.raises(CheckpointFormatError, match=r"config.json: Qwen3Moe\w+, the model it"):
        plan_names(stored, config)


def test_names_of_another_model_under_a_table_type_are_asked_of_transformers():
    """torchtitan's names with a llama config.json were written as stored, exit 0, "llama:
    needs no mapping" (its ``layers.N.`` matched the table): a model of all-missing weights."""
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 32}  # fmt: skip
    stored = [
        ("tok_embeddings.weight", "F32", (32, 8)),
        ("layers.0.attention.wq.weight", "F32", (8, 8)),
        ("layers.0.attention_norm.weight", "F32", (8,)),
        ("norm.weight", "F32", (8,)),
        ("output.weight", "F32", (32, 8)),
    ]
    with pytest.raises(CheckpointFormatError, match=r"holds none of the checkpoint's tensors"):
        plan_names(stored, config)


def test_a_table_type_missing_a_layer_s_weight_or_its_final_norm_is_refused():
    """A llama checkpoint without one layer's post_attention_layernorm (a rank file's key
    lost, a DCP entry stored as bytes) merged exit 0: the model loaded it at random."""
    config = {"model_type": "llama"}
    layer = sorted(hf_names.table_layer_tensors("llama", config))
    whole = [f"model.layers.{i}.{w}" for i in range(3) for w in layer]
    whole += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    hf_names.check_whole_table_layers(whole, config)
    lost = [n for n in whole if n != "model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(CheckpointFormatError, match=r"no model\.layers\.1\.post_attention"):
        hf_names.check_whole_table_layers(lost, config)
    with pytest.raises(CheckpointFormatError, match=r"final norm model\.norm\.weight"):
        hf_names.check_whole_table_layers([n for n in whole if n != "model.norm.weight"], config)
    hf_names.check_whole_table_layers(lost, {"model_type": "qwen3_moe"})  # not the table's


def test_a_table_type_missing_a_weight_from_every_layer_is_refused():
    """A checkpoint without the attention's query projection in any layer (saved without
    frozen parameters; a filtered state dict) merged exit 0, every layer consistent with the
    others, and the loaded model started them at random. Quantized weights go by other
    names: not checked."""
    config = {"model_type": "qwen2"}
    layer = sorted(hf_names.table_layer_tensors("qwen2", config))
    assert "self_attn.q_proj.bias" in layer  # Qwen2's query, key and value carry biases
    whole = [f"model.layers.{i}.{w}" for i in range(2) for w in layer]
    whole += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    hf_names.check_whole_table_layers(whole, config)
    lost = [n for n in whole if ".q_proj." not in n]
    with pytest.raises(
        CheckpointFormatError,
        match=r"no model\.layers\.0\.self_attn\.q_proj\.bias in any of its 2 layers \(2 weight",
    ):
        hf_names.check_whole_table_layers(lost, config)
    quantized = {**config, "quantization_config": {"quant_method": "gptq"}}
    hf_names.check_whole_table_layers(lost, quantized)


@pytest.mark.parametrize("model_type", sorted(hf_names.TABLE_LAYER_WEIGHTS))
def test_the_table_names_what_every_layer_of_its_types_holds(model_type):
    """``table_layer_tensors`` is what the installed transformers' decoder layer holds, built
    from the class's default config on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    held = {n.split(".", 3)[3] for n, _ in model.named_parameters() if ".layers.0." in n}
    assert hf_names.table_layer_tensors(model_type, config.to_dict()) == held


def test_table_shapes_config_json_leaves_undetermined_are_still_checked():
    """A bias of another shape than its weight's rows, a head of another shape, key-value
    projections not of num_key_value_heads (head_dim left out of config.json, as Qwen2's
    is): merged exit 0, and transformers refused to load the output."""
    config = {"model_type": "qwen2", "hidden_size": 8, "vocab_size": 16,
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    good = {
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.q_proj.bias": (8,),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.norm.weight": (8,),
        "lm_head.weight": (16, 8),
    }
    hf_names.check_table_widths(list(good.items()), config)
    for name, shape, words in [
        ("model.layers.0.self_attn.q_proj.bias", (8, 1), "its bias would be"),
        ("lm_head.weight", (128,), "so it would be"),
        ("model.norm.weight", (16,), "hidden_size 8"),
        ("model.layers.0.self_attn.q_proj.weight", (8, 8, 1), "as a matrix"),
    ]:
        with pytest.raises(CheckpointFormatError, match=words):
            hf_names.check_table_widths(list({**good, name: shape}.items()), config)
    with pytest.raises(CheckpointFormatError, match="k_proj would have 8 rows"):
        hf_names.check_table_widths(list(good.items()), {**config, "num_key_value_heads": 4})


def test_without_transformers_only_types_known_to_need_no_mapping(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    plan = plan_names([("_orig_mod.model.norm.weight", "F32", (4,))], {"model_type": "qwen2"})
    assert [p.name for p in plan.pieces] == ["model.norm.weight"]
    with pytest.raises(UsageError, match=r"'qwen3_moe'.*pip install transformers"):
        plan_names([("model.norm.weight", "F32", (4,))], {"model_type": "qwen3_moe"})
    assert gc.isenabled()  # the collector paused for the import is back on after the refusal


def test_planning_with_transformers_pauses_the_collector(monkeypatch, qwen3_moe_config):
    """transformers' import and trace run with the cyclic collector off, which is on again
    after, with the import's objects aged: no young pile for the next collection to walk."""
    seen, kept = [], []
    trace = hf_names._trace_v5

    def watched(plain, config, tied=()):
        seen.append(gc.isenabled())
        kept.extend([] for _ in range(5000))  # what an import leaves in the youngest generation
        assert gc.get_count()[0] >= len(kept)
        monkeypatch.setitem(sys.modules, "_imported_by_the_trace", sys)  # as an import does
        return trace(plain, config, tied)

    monkeypatch.setattr(hf_names, "_trace_v5", watched)
    monkeypatch.setattr(hf_names, "_PLANS", {})
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    assert gc.isenabled()
    plan_names([("model.norm.weight", "F32", (8,))], qwen3_moe_config)
    assert seen == [False] and gc.isenabled()
    assert id(kept[0]) in {id(o) for o in gc.get_objects(generation=2)}


def test_the_collector_held_ages_what_an_import_left_on_the_main_thread(monkeypatch):
    assert gc.isenabled() and not gc.get_freeze_count()
    with imports_collector_held():
        assert not gc.isenabled()
        kept = [[] for _ in range(5000)]
        monkeypatch.setitem(sys.modules, "_imported_meanwhile", sys)
    assert gc.isenabled() and not gc.get_freeze_count()
    assert id(kept[0]) in {id(o) for o in gc.get_objects(generation=2)}
    # nothing imported: nothing aged
    with imports_collector_held():
        young = [[] for _ in range(10)]
    assert id(young[0]) not in {id(o) for o in gc.get_objects(generation=2)}
    # objects the process keeps frozen itself stay frozen (the count itself can fall: a frozen
    # object another thread lets go of, such as pytest-xdist's, leaves the frozen generation)
    held_frozen = []
    gc.freeze()
    try:
        with imports_collector_held():
            monkeypatch.setitem(sys.modules, "_imported_too", sys)
        assert gc.get_freeze_count()
        assert id(held_frozen) not in {id(o) for o in gc.get_objects()}  # not back in a generation
    finally:
        gc.unfreeze()


def test_the_collector_held_leaves_the_collector_alone_off_the_main_thread(monkeypatch):
    """The switch is process-wide: off the main thread (an async save's export) nothing
    changes."""
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    seen = []

    def plan():
        with imports_collector_held():
            seen.append(gc.isenabled())

    thread = threading.Thread(target=plan)
    thread.start()
    thread.join()
    assert seen == [True] and not frozen


def test_a_computed_tensor_is_refused_naming_it(monkeypatch, qwen3_moe_config):
    # modeling_utils binds the function when first imported: imported here before the patch,
    # it keeps the real one for the tests after this (save_pretrained calls it).
    import transformers.modeling_utils  # noqa: F401
    from transformers import core_model_loading

    def concatenating(model, state_dict):
        return {"fused.weight": torch.cat(list(state_dict.values()))}

    monkeypatch.setattr(core_model_loading, "revert_weight_conversion", concatenating)
    config = qwen3_moe_config
    with pytest.raises(CheckpointFormatError, match=r"'fused\.weight'.*--keep-names"):
        plan_names(
            [
                ("model.norm.weight", "F32", (8,)),
                ("model.layers.0.post_attention_layernorm.weight", "F32", (8,)),
            ],
            config,
        )


def test_transformers_4_reverses_the_checkpoint_conversion_mapping(monkeypatch):
    import transformers

    class Qwen2_5_VLOld(
        transformers.PreTrainedModel
    ):  # transformers 4.5x's Qwen2.5-VL mapping (checkpoint pattern -> in-memory)
        config_class = transformers.Qwen2_5_VLConfig
        _checkpoint_conversion_mapping = {
            "^visual": "model.visual",
            r"^model(?!\.(language_model|visual))": "model.language_model",
        }

    monkeypatch.setattr(hf_names, "has_weight_conversions", lambda: False)
    monkeypatch.setattr(transformers, "Qwen2_5_VLOld", Qwen2_5_VLOld, raising=False)
    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLOld"]}
    stored = [
        ("model.visual.blocks.0.w", "F32", (2,)),
        ("model.language_model.layers.0.w", "F32", (2,)),
        ("lm_head.weight", "F32", (2,)),
    ]
    names = [p.name for p in plan_names(stored, config).pieces]
    assert names == ["visual.blocks.0.w", "model.layers.0.w", "lm_head.weight"]


def _execute(tensor: GlobalTensor, files: dict[str, np.ndarray]) -> np.ndarray:
    """Copy ``tensor`` (its blocks in ``files``, float32) into a dense array by its runs."""
    out = np.zeros(math.prod(tensor.shape), np.float32)
    dst = dense_block("out", 0, "F32", tensor.shape)
    for block in tensor.blocks:
        for run in plan_copy(tensor.name, tensor.shape, block, dst):
            src = files[run.src]
            for k in range(run.count):
                s = (run.src_offset + k * run.src_step) // 4
                d = (run.dst_offset + k * run.dst_step) // 4
                out[d : d + run.elems] = src[s : s + run.elems]
    return out.reshape(tensor.shape)


@pytest.mark.parametrize("world, dim", [(2, 0), (4, 0), (2, 1)])
def test_slices_of_a_sharded_fused_tensor_plan_their_bytes(world, dim):
    """Every expert and gate/up half, planned from the shards the ranks saved: the runs read
    exactly the slice's elements."""
    e, i2, h = 3, 6, 5
    full = np.arange(e * i2 * h, dtype=np.float32).reshape(e, i2, h)
    parts = np.array_split(full, world, axis=dim) if dim else None
    files, blocks = {}, []
    if dim == 0:
        offsets = array("q")
        step = -(-e // world)
        for r in range(world):
            rows = full[r * step : (r + 1) * step]
            if not len(rows):
                break
            files[f"rank{r}"] = rows.reshape(-1).copy()
            offsets.append(0)
        paths = [f"rank{r}" for r in range(len(offsets))]
        blocks = GridBlocks("F32", full.shape, world, paths, offsets)
    else:
        start = 0
        for r, part in enumerate(parts):
            files[f"rank{r}"] = part.reshape(-1).copy()
            shape = part.shape
            blocks.append(
                Block(f"rank{r}", 0, "F32", (0, start, 0), shape, row_major_strides(shape))
            )
            start += shape[1]
    stored = GlobalTensor("experts.gate_up_proj", "F32", full.shape, blocks)
    for x in range(e):
        for half in range(2):
            box = slice_tensor(stored, (x, half * 3, 0), (1, 3, h), (1, 2))
            assert box.shape == (3, h) and box.name == stored.name
            np.testing.assert_array_equal(_execute(box, files), full[x, half * 3 : half * 3 + 3])


def test_experts_share_the_storage_save_pretrained_gives_them(qwen3_moe_config):
    """down_proj's experts are views of the fused tensor; gate and up halves are each a copy
    (Chunk's contiguous) whose experts are views of it: three storages per layer."""
    config = qwen3_moe_config
    e, i, h = 3, 6, 8
    stored = [
        ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (e, 2 * i, h)),
        ("model.layers.0.mlp.experts.down_proj", "BF16", (e, h, i)),
        ("model.norm.weight", "BF16", (h,)),
    ]
    storage = plan_names(stored, config).storage()
    groups: dict[int, list[str]] = {}
    for name, (index, _) in storage.items():
        groups.setdefault(index, []).append(name.split(".")[-2])
    assert sorted(map(sorted, groups.values())) == [
        ["down_proj"] * e,
        ["gate_proj"] * e,
        ["norm"],
        ["up_proj"] * e,
    ]
    assert {storage[f"model.layers.0.mlp.experts.{x}.down_proj.weight"][1] for x in range(e)} == {
        e * h * i
    }


def test_files_split_like_huggingface_hub_with_shared_storage():
    from shardstream.formats import hf
    from shardstream.formats.writer import OutputTensor

    def out(name: str, n: int) -> OutputTensor:
        return OutputTensor(name, "F32", GlobalTensor(name, "F32", (n,), ()))

    tensors = [out("a", 10), out("e0", 10), out("b", 10), out("e1", 10), out("e2", 10)]
    storage = {"e0": (0, 30), "e1": (0, 30), "e2": (0, 30)}
    # 40 B each, the experts' storage 120 B, counted once and holding its three tensors
    files = hf.plan_hf_files(tensors, 150, storage)
    assert [sorted(t.name for t in group) for _, group in files] == [
        ["a"],
        ["e0", "e1", "e2"],
        ["b"],
    ]


def test_a_view_of_a_tensor_without_elements_is_whole_or_an_empty_box():
    """No element tells where such a view lies, and none is copied: an expert of a fused
    tensor of width 0 is a box of no elements, its dims matched by size (save_pretrained
    writes such [0, H] tensors)."""
    base = torch.empty(0, device="meta")
    stored = base[0:0].view(3, 0, 8)
    assert hf_names._as_box("out", "fused", (3, 0, 8), stored, 0).whole
    piece = hf_names._as_box("out", "fused", (3, 0, 8), stored[1], 0)
    assert (piece.shape, piece.extent, piece.dims, piece.whole) == (
        (0, 8),
        (1, 0, 8),
        (1, 2),
        False,
    )
    assert hf_names._as_box("out", "fused", (3, 0, 8), base[0:0].view(0, 9), 0) is None  # no fit


def _layers(prefix: str, indices) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{prefix}{i}.mlp.up_proj.weight", "F32", (4, 2)) for i in indices]


@pytest.mark.parametrize(
    "indices, shown",
    [((0, 1, 2), "0-2"), ((0,), "0"), ((0, 1, 3), "0-1, 3"), ((1, 2), "1-2")],
    ids=["more", "fewer", "a_gap", "not_from_0"],
)
def test_stored_layers_other_than_the_config_s_are_refused(indices, shown):
    config = {"model_type": "qwen2", "num_hidden_layers": 2}
    names = [n for n, _, _ in _layers("model.layers.", indices)]
    message = rf"^c\.json: num_hidden_layers is 2, .* model\.layers\.N for N in {shown}:"
    with pytest.raises(CheckpointFormatError, match=message):
        hf_names.check_stored_layers(names, config, "c.json")


def test_stored_layers_of_the_config_s_depth_or_with_its_mtp_layers_pass():
    hf_names.check_stored_layers(["model.layers.0.w", "model.layers.1.w"], {"num_hidden_layers": 2})
    mtp = {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    for depth in (2, 3):  # the in-memory model has no MTP layer; a HF checkpoint stores it
        hf_names.check_stored_layers([n for n, _, _ in _layers("model.layers.", range(depth))], mtp)
    with pytest.raises(CheckpointFormatError, match="N in 0-3"):
        hf_names.check_stored_layers([n for n, _, _ in _layers("model.layers.", range(4))], mtp)


def test_a_config_counting_sublayers_passes_by_its_num_layers():
    """transformers 4.57's LongcatFlash: num_layers 2 decoder layers, num_hidden_layers 4
    (two sublayers each); its own save_pretrained output was refused."""
    names = ["model.layers.0.w", "model.layers.1.w"]
    hf_names.check_stored_layers(names, {"num_hidden_layers": 4, "num_layers": 2})
    with pytest.raises(CheckpointFormatError, match="num_hidden_layers is 4"):
        hf_names.check_stored_layers(names, {"num_hidden_layers": 4, "num_layers": 3})


def test_a_vlm_s_language_layers_are_counted_by_its_text_config():
    config = {"model_type": "x", "text_config": {"num_hidden_layers": 3}}
    names = [n for n, _, _ in _layers("model.language_model.layers.", range(3))]
    hf_names.check_stored_layers(names, config)
    hf_names.check_stored_layers(names + ["model.visual.blocks.7.w"], config)  # not counted
    with pytest.raises(
        CheckpointFormatError, match=r"model\.language_model\.layers\.N for N in 0-1"
    ):
        hf_names.check_stored_layers(names[:2], config)


def test_a_huge_layer_count_is_refused_without_counting_to_it():
    names = [n for n, _, _ in _layers("model.layers.", range(2))]
    with pytest.raises(
        CheckpointFormatError, match="num_hidden_layers is 1,000,000,000,000|is 1000000000000"
    ):
        hf_names.check_stored_layers(names, {"num_hidden_layers": 10**12})


def test_a_chunk_from_the_origin_is_a_part_not_the_whole_tensor():
    """transformers saves OLMo-Hybrid's fused conv1d as q/k/v parts (chunks along dim 0): the
    first one starts where the stored tensor does and was planned as the whole of it (merge
    wrote the fused tensor under the first part's name, exit 0)."""
    import torch

    base = torch.empty(64, device="meta")
    fused = base[: 12 * 4].view(12, 1, 4)
    pieces = [
        hf_names._as_box(f"p{i}", "conv", (12, 1, 4), c, 0) for i, c in enumerate(fused.chunk(3))
    ]
    assert [(p.start, p.extent, p.shape, p.whole) for p in pieces] == [
        ((0, 0, 0), (4, 1, 4), (4, 1, 4), False),
        ((4, 0, 0), (4, 1, 4), (4, 1, 4), False),
        ((8, 0, 0), (4, 1, 4), (4, 1, 4), False),
    ]
    assert hf_names._as_box("all", "conv", (12, 1, 4), fused, 0).whole


# A model type planned without building the model: config.json's widths are checked by name.
WIDE = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 12, "vocab_size": 16}  # fmt: skip


def _layer(intermediate: int = 12, head: str = "lm_head") -> list[tuple[str, tuple]]:
    return [
        ("model.embed_tokens.weight", (16, 8)),
        ("model.layers.0.self_attn.q_proj.weight", (8, 8)),
        ("model.layers.0.self_attn.k_proj.weight", (4, 8)),
        ("model.layers.0.self_attn.o_proj.weight", (8, 8)),
        ("model.layers.0.mlp.up_proj.weight", (intermediate, 8)),
        ("model.layers.0.mlp.down_proj.weight", (8, intermediate)),
        (f"{head}.weight", (16 if head == "lm_head" else 1, 8)),
    ]


def test_a_config_of_other_widths_is_refused_naming_the_tensor():
    hf_names.check_table_widths(_layer(), WIDE)
    with pytest.raises(CheckpointFormatError, match=r"intermediate_size 12.*up_proj.*\[16, 8\]"):
        hf_names.check_table_widths(_layer(intermediate=16), WIDE)
    # a model type the model is built for is checked by the model, not by these names
    hf_names.check_table_widths(_layer(intermediate=16), {**WIDE, "model_type": "qwen3_moe"})


def test_fields_config_json_leaves_out_are_not_guessed():
    """A field config.json leaves out takes its class's default (Qwen3's head_dim 128,
    Mistral's 8 key-value heads), not hidden_size / heads: such a checkpoint was refused."""
    qwen3 = {**WIDE, "model_type": "qwen3"}
    del qwen3["num_key_value_heads"]
    layer = dict(_layer())
    layer["model.layers.0.self_attn.q_proj.weight"] = (256, 8)  # 2 heads x head_dim 128
    layer["model.layers.0.self_attn.k_proj.weight"] = (1024, 8)  # 8 kv heads x 128
    hf_names.check_table_widths(list(layer.items()), qwen3)
    # quantized weights are packed: not these widths
    hf_names.check_table_widths(_layer(intermediate=3), {**WIDE, "quantization_config": {}})


def test_a_classifier_config_needs_its_score_head_stored():
    critic = {**WIDE, "architectures": ["Qwen2ForTokenClassification"]}
    with pytest.raises(CheckpointFormatError, match="score head the checkpoint does not hold"):
        hf_names.check_table_widths(_layer(), critic)
    hf_names.check_table_widths(_layer(head="score"), critic)
    hf_names.check_table_widths(_layer(head="classifier"), critic)  # Phi3's under 4.x
    hf_names.check_table_widths(_layer(), {**WIDE, "architectures": ["Qwen2ForCausalLM"]})


TABLE_CONFIGS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 6}, "gemma": {"head_dim": 6},
    "gemma2": {"head_dim": 6}, "starcoder2": {}, "olmo2": {},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(hf_names.NO_MAPPING_MODEL_TYPES))
def test_every_table_class_agrees_with_its_own_config(model_type):
    """No false refusal: each class of the table, built from its config on the meta device,
    agrees with that config.json."""
    transformers = pytest.importorskip("transformers")
    import torch

    fields = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **fields, **TABLE_CONFIGS[model_type])
    heads = ("AutoModelForCausalLM", "AutoModelForTokenClassification")
    for auto in (*heads, "AutoModelForSequenceClassification", "AutoModel"):
        with torch.device("meta"):
            try:
                model = getattr(transformers, auto).from_config(config)
            except ValueError:  # no such class of the type (OLMo 2's token classifier)
                assert auto != "AutoModelForCausalLM"
                continue
        # every name the class holds is one the table decides without asking transformers
        off_table = [n for n in model.state_dict() if not hf_names.TABLE_NAMES.match(n)]
        assert not off_table, (model_type, auto, off_table)
        if auto not in heads:
            continue
        document = {**config.to_dict(), "architectures": [type(model).__name__]}
        shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
        checked = [n for n, _ in shapes if any(n.endswith(k) for k in hf_names.TABLE_WIDTHS)]
        assert checked, model_type
        hf_names.check_config_agrees(shapes, document)


@pytest.mark.parametrize("model_type", sorted(hf_names.NO_MAPPING_MODEL_TYPES))
def test_the_table_s_biases_are_its_classes(model_type):
    """``TABLE_BIASES`` against each class, with each of its switches flipped: the biases a
    decoder layer holds are exactly the ones the table allows."""
    transformers = pytest.importorskip("transformers")
    import torch

    fields = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    switches = [(s, d) for s, d, _ in hf_names.TABLE_BIASES[model_type] if s is not None]
    for flipped in [{}, *({s: not d} for s, d in switches)]:
        extra = {**TABLE_CONFIGS[model_type], **flipped}
        config = transformers.AutoConfig.for_model(model_type, **fields, **extra)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        document = {**config.to_dict(), **flipped}
        layer = [
            n.removeprefix("model.layers.0.")
            for n, _ in model.named_parameters()
            if n.startswith("model.layers.0.") and n.split(".")[3] in ("self_attn", "mlp")
        ]
        modules = {n.removesuffix(".weight") for n in layer if n.endswith(".weight")}
        held = {n.removesuffix(".bias") for n in layer if n.endswith(".bias")}
        allowed = {m for m in modules if hf_names.table_bias_allowed(model_type, document, m)}
        assert held == allowed, (model_type, flipped)


def test_biases_a_table_config_rules_out_are_refused():
    """A Qwen2 checkpoint (q/k/v biases) with a Llama config.json merged exit 0: transformers
    then built the Llama model without the biases, and dropped them."""
    llama = {**WIDE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    biased = [*_layer(), ("model.layers.0.self_attn.q_proj.bias", (8,))]
    with pytest.raises(
        CheckpointFormatError, match=r"attention_bias unset \(false\).*q_proj\.bias"
    ):
        hf_names.check_table_widths(biased, llama)
    hf_names.check_table_widths(biased, {**llama, "attention_bias": True})
    hf_names.check_table_widths(biased, WIDE)  # qwen2: always
    with pytest.raises(CheckpointFormatError, match="a qwen2 model holds no .*o_proj.bias"):
        hf_names.check_table_widths(
            [*_layer(), ("model.layers.0.self_attn.o_proj.bias", (8,))], WIDE
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", float("nan")), ("vocab_size", 16.0), ("num_attention_heads", 0),
     ("num_key_value_heads", -1), ("intermediate_size", True)],
)  # fmt: skip
def test_a_table_config_size_transformers_refuses_is_refused(field, value):
    with pytest.raises(CheckpointFormatError, match=f"{field} is .*, not a positive integer"):
        hf_names.check_table_widths(_layer(), {**WIDE, field: value})


def test_a_config_json_without_a_model_type_is_said():
    """Its output loads in no transformers class: merge's layout line says so."""
    plan = hf_names.plan_names([("model.norm.weight", "F32", (8,))], {"hidden_size": 8})
    assert "config.json names no model_type, so transformers loads no model" in plan.rule
    plan = hf_names.plan_names([("model.norm.weight", "F32", (8,))], {})  # no config.json
    assert "no config.json" in plan.rule


@pytest.mark.parametrize("layout", ["in-memory", "saved"])
def test_a_tensor_missing_from_every_layer_of_a_planned_model_is_refused(tmp_path, layout):
    """Qwen3-MoE (planned by transformers): a checkpoint without any layer's q_proj holds
    every part of the model (``model.layers`` among them), so the check by part passed it
    and merge wrote a model that loads q_proj at random; it is refused by name now, in the
    in-memory names and in save_pretrained's."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    if not hf_names.has_weight_conversions():
        pytest.skip("transformers 4.x is planned by its renames alone, without this check")
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=32, head_dim=8,
        num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path)
    state = (
        model.state_dict() if layout == "in-memory" else load_file(tmp_path / "model.safetensors")
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    whole = [(n, "F32", tuple(t.shape)) for n, t in state.items()]
    hf_names.plan_checkpoint_names(whole, saved)
    lost = [t for t in whole if "q_proj" not in t[0]]
    with pytest.raises(
        CheckpointFormatError,
        match=r"holds nothing of model\.layers\.0\.self_attn\.q_proj\.weight, "
        r"model\.layers\.1\.self_attn\.q_proj\.weight, which",
    ):
        hf_names.plan_checkpoint_names(lost, saved)


def test_a_causal_lm_whose_config_unties_the_head_needs_it_stored():
    """torchtitan's HF export of a tied model merged beside a Qwen3 config.json that unties
    the head (Qwen3's default) wrote no lm_head.weight, exit 0, and transformers started it
    at random. A critic's score head stands for it; a config that ties it, or leaves the key
    to the class's default, is not refused here."""
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    layer = sorted(hf_names.table_layer_tensors("qwen3", config))
    body = [f"model.layers.0.{w}" for w in layer] + [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    untied = {**config, "tie_word_embeddings": False}
    hf_names.check_whole_table_layers([*body, "lm_head.weight"], untied)
    with pytest.raises(
        CheckpointFormatError, match=r"holds no lm_head\.weight, which Qwen3ForCausalLM"
    ):
        hf_names.check_whole_table_layers(body, untied)
    hf_names.check_whole_table_layers([*body, "score.weight"], untied)
    hf_names.check_whole_table_layers(body, {**config, "tie_word_embeddings": True})
    hf_names.check_whole_table_layers(body, config)


def test_torchtitans_own_names_are_said_to_be_torchtitans():
    """A torchtitan checkpoint merged beside a Qwen3 config.json is refused (its names are not
    the model's), but the reason said was a damaged or partly saved checkpoint."""
    titan = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(2):
        titan += [f"layers.{i}.attention.qkv_linear.wq.weight", f"layers.{i}.attention.wo.weight"]
        titan += [f"layers.{i}.feed_forward.w1.weight", f"layers.{i}.attention_norm.weight"]
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    hf_names.check_whole_table_layers(titan, config)  # not the table's names: not its check
    told = {n for n in titan if hf_names.TORCHTITAN_NAMES.fullmatch(n)}
    assert told == {n for n in titan if "attention." in n or "feed_forward." in n} | {titan[0]}
    assert "torchtitan's own ('tok_embeddings.weight')" in hf_names.native_names_hint(titan)
    for hugging_face in (  # GPT-NeoX's, Jamba's and Llama 4's names are not torchtitan's
        "model.layers.0.self_attn.q_proj.weight",
        "gpt_neox.layers.0.attention.dense.weight",
        "model.layers.0.feed_forward.router.weight",
        "model.layers.0.feed_forward.w1.weight",
    ):
        assert not hf_names.TORCHTITAN_NAMES.fullmatch(hugging_face)


def test_torchtunes_own_names_are_said_to_be_torchtunes_and_kept_on_request():
    """torchtune's DCP and .pt saves use its own names (attn.q_proj, mlp.w1, norm.scale; Llama's
    q and k permuted): merge beside a config.json said 'Fix architectures', and --keep-names
    then said the checkpoint was damaged (no norm.weight)."""
    tune = ["tok_embeddings.weight", "norm.scale", "output.weight"]
    for i in range(2):
        tune += [f"layers.{i}.attn.{p}_proj.weight" for p in ("q", "k", "v", "output")]
        tune += [f"layers.{i}.mlp.w{k}.weight" for k in (1, 2, 3)]
        tune += [f"layers.{i}.sa_norm.scale", f"layers.{i}.mlp_norm.scale"]
    hint = hf_names.native_names_hint(tune)
    assert "torchtune's own ('norm.scale')" in hint and "FullModelHFCheckpointer" in hint
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    hf_names.check_whole_table_layers(tune, {**config, "tie_word_embeddings": False})
    assert hf_names.native_names_hint(["model.layers.0.self_attn.q_proj.weight"]) == ""
