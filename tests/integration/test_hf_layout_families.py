"""merge writes what ``save_pretrained`` writes, across model families whose saved layout
differs from their in-memory names under the installed transformers: MoE models whose experts
are fused in memory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3), renamed ones
(GraniteMoE, and the vision-language models), a fused tensor saved in parts (OLMo-Hybrid's
conv1d), and models saved as held (GPT-OSS, Gemma 3).

Each tiny model (random weights, built from a config) is written as its in-memory state dict
(``safetensors.torch.save_file``, beside its config.json) and merged; the merge must equal
``save_pretrained``'s files tensor for tensor, bit for bit, index included.
"""

from __future__ import annotations

import pytest
import torch

from shardstream import merge
from shardstream.errors import CheckpointFormatError
from shardstream.testing.tiny_models import randomized

from .test_hf_layout import assert_same_model_files

transformers = pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64,
)  # fmt: skip
EXPERTS = dict(num_experts_per_tok=2)

FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**TEXT, **EXPERTS, "num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**TEXT, **EXPERTS, "num_experts": 4, "moe_intermediate_size": 8,
         "shared_expert_intermediate_size": 16},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**TEXT, **EXPERTS, "num_experts": 4, "moe_intermediate_size": 8, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**TEXT, **EXPERTS, "num_experts": 4}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {**TEXT, **EXPERTS, "num_local_experts": 4}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**TEXT, **EXPERTS, "intermediate_size": 32, "num_key_value_heads": 4,
         "moe_intermediate_size": 8, "n_routed_experts": 4, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 8,
         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "n_group": 1,
         "topk_group": 1},
    ),
    "granitemoe": (
        "GraniteMoeConfig", "GraniteMoeForCausalLM", {**TEXT, **EXPERTS, "num_local_experts": 4}
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**TEXT, **EXPERTS, "num_local_experts": 4, "head_dim": 8},
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**TEXT, "head_dim": 8}),
    # transformers 4.57 writes model_type "lfm2-vl", which its config mapping spells
    # "lfm2_vl": the class's rules (a tied head) went unapplied.
    "lfm2_vl": (
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        {"text_config": {**TEXT, "layer_types": ["conv", "full_attention"]},
         "vision_config": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2},
         "projector_hidden_size": 32},
    ),
    # An input embedding of vocab_size + 1 rows by design: refused as another model's.
    "moshi": (
        "MoshiConfig",
        "MoshiForCausalLM",
        {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "ffn_dim": 64, "audio_vocab_size": 16, "num_codebooks": 2,
         "depth_decoder_config": {"hidden_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "ffn_dim": 64}},
    ),
    # transformers 4.x lists the one word embedding kept among its tied names: it was dropped.
    "prophetnet": (
        "ProphetNetConfig",
        "ProphetNetForCausalLM",
        {"vocab_size": 64, "hidden_size": 32, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
         "num_encoder_layers": 1, "num_decoder_layers": 1, "num_encoder_attention_heads": 2,
         "num_decoder_attention_heads": 2, "max_position_embeddings": 64},
    ),
    # config.json ties the head (the default), the class does not (transformers 5 ties only
    # what _tied_weights_keys names): save_pretrained writes lm_head, which merge left out and
    # then refused as missing.
    "bigbird_pegasus": (
        "BigBirdPegasusConfig",
        "BigBirdPegasusForCausalLM",
        {"vocab_size": 64, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
         "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
         "decoder_ffn_dim": 32, "max_position_embeddings": 64,
         "attention_type": "original_full"},
    ),
    # A model type transformers' auto classes build with another type's class.
    "exaone": ("ExaoneConfig", "LlamaForCausalLM", {**TEXT, "pad_token_id": 1}),
    # Saved names that are in-memory names of other tensors too (hc_pre.hc_head.*).
    "hy_v4": (
        "HYV4Config",
        "HYV4ForCausalLM",
        {**TEXT, **EXPERTS, "num_key_value_heads": 4, "head_dim": 4, "intermediate_size": 48,
         "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 1,
         "layer_types": ["indexed_attention", "indexed_attention"],
         "mlp_layer_types": ["dense", "sparse"], "kv_lora_rank": 8, "q_lora_rank": 16,
         "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 8, "index_head_dim": 8,
         "index_n_heads": 2, "hc_mult": 4, "n_group": 1, "topk_group": 1, "pad_token_id": 1},
    ),
    # One fused conv1d saved as q/k/v parts: chunks along dim 0, the first from the origin.
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        {**TEXT, "layer_types": ["linear_attention", "full_attention"],
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "pad_token_id": 1},
    ),
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {"text_config": {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
         "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2,
                           "mlp_ratio": 2, "patch_size": 2, "spatial_merge_size": 1,
                           "temporal_patch_size": 1}},
    ),
    "llava": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        {"text_config": {**TEXT, "model_type": "llama"},
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16,
                           "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 8, "patch_size": 4,
                           "projection_dim": 16},
         "image_token_index": 3},
    ),
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {"text_config": {**TEXT, "head_dim": 8, "vocab_size": 300},
         "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
         "mm_tokens_per_image": 4, "image_token_index": 5, "boi_token_index": 6,
         "eoi_token_index": 7},
    ),
}  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    config_name, class_name, fields = FAMILIES[family]
    if not hasattr(transformers, config_name):  # a model type newer than the installed one
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(0)
    return randomized(getattr(transformers, class_name)(config))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_in_memory_state_dict_merges_to_what_save_pretrained_writes(tmp_path, family):
    from safetensors.torch import save_file

    model = _model(family)
    model.save_pretrained(tmp_path / "reference")
    state, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in stored:  # a tied head shares the embedding's storage
            stored.add(tensor.data_ptr())
            state[name] = tensor.contiguous().clone()
    (tmp_path / "state").mkdir()
    save_file(state, str(tmp_path / "state" / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "state")

    summary = merge(tmp_path / "state", tmp_path / "merged", dtype="float32")
    assert "transformers" in summary.layout and not summary.kept_names
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_stored_name_tests_equal_to_save_pretrained(tmp_path, family, capsys):
    """Every name of the state dict stored, a tied head too (DCP and verl store both names):
    ``shardstream test`` against save_pretrained's files renamed the tied head
    (``language_model.lm_head.weight`` for Gemma 3's VLM) and then kept it, "unexpected",
    where merge leaves it out."""
    from safetensors.torch import save_file

    from shardstream import cli

    model = _model(family)
    model.save_pretrained(tmp_path / "reference")
    state = {name: tensor.contiguous().clone() for name, tensor in model.state_dict().items()}
    (tmp_path / "state").mkdir()
    save_file(state, str(tmp_path / "state" / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "state")
    argv = ["--local_dir", tmp_path / "state", "--test_hf_dir", tmp_path / "reference"]
    assert cli.main(["test", *map(str, argv), "--exact"]) == 0, capsys.readouterr().err
    merge(tmp_path / "state", tmp_path / "merged", dtype="float32")
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")
    # split small: the index too, its total_parameters without persistent buffers
    model.save_pretrained(tmp_path / "split", max_shard_size="8KB")
    merge(tmp_path / "state", tmp_path / "merged-split", dtype="float32", max_shard_size="8KB")
    assert_same_model_files(tmp_path / "merged-split", tmp_path / "split")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_save_pretrained_directory_merges_to_itself(tmp_path, family):
    """save_pretrained's own files (the Hub's, the Trainer's) as the checkpoint: PaliGemma's,
    Gemma 3's and other VLMs' hold none of the model's in-memory names
    (``language_model.model.*`` for ``model.language_model.*``), and merge refused them
    ("config.json ... holds none of the checkpoint's tensors")."""
    model = _model(family)
    model.save_pretrained(tmp_path / "reference")
    summary = merge(tmp_path / "reference", tmp_path / "merged", dtype="float32")
    assert not summary.kept_names
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_files_split_small_merge_to_the_same_split(tmp_path, family):
    """Split at a small size, merge put other tensors in each file than save_pretrained (55
    of 102 families): it split them in the input files' order (by name), not the model's, and
    counted an expert of a fused tensor apart from its siblings, which save_pretrained keeps
    together as views of one storage. The index's total_parameters is the model's parameter
    count, no persistent buffers (DeepSeek-V3's e_score_correction_bias were counted)."""
    model = _model(family)
    model.save_pretrained(tmp_path / "reference", max_shard_size="8KB")
    merge(tmp_path / "reference", tmp_path / "merged", dtype="float32", max_shard_size="8KB")
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_save_pretrained_directory_restores_into_the_model(tmp_path, family):
    """``shardstream.load`` of save_pretrained's files reads them into the live model's own
    names by the same layout rule: OLMo-Hybrid's conv1d, saved in parts, was refused as
    "saved from another model" (its first part was planned as the whole tensor)."""
    import shardstream

    model = _model(family)
    model.save_pretrained(tmp_path / "reference")
    torch.manual_seed(1)
    fresh = randomized(type(model)(model.config))
    shardstream.load(tmp_path / "reference", model=fresh, contents=("model",))
    saved, restored = model.state_dict(), fresh.state_dict()
    assert restored.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name


ENCODER_DECODER = {
    "t5": ("T5Config", "T5ForConditionalGeneration",
           {"vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1,
            "num_heads": 2}),
    "t5-untied": ("T5Config", "T5ForConditionalGeneration",
                  {"vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1,
                   "num_heads": 2, "tie_word_embeddings": False}),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {"vocab_size": 64, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
              "encoder_attention_heads": 2, "decoder_attention_heads": 2,
              "encoder_ffn_dim": 32, "decoder_ffn_dim": 32}),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(ENCODER_DECODER))
def test_aliases_of_one_parameter_are_written_once(tmp_path, family):
    """T5 and BART hold one embedding under several names (``shared``, ``encoder.`` and
    ``decoder.embed_tokens``, tied or not): a sharded save (DCP, verl) stores each name, and
    the merge leaves out the ones ``save_pretrained`` leaves out; ``shardstream test``
    against save_pretrained's output then compares the same tensors."""
    from safetensors.torch import save_file

    from shardstream.testing.cli import main_stdout

    config_name, class_name, fields = ENCODER_DECODER[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**fields)
    model = randomized(getattr(transformers, class_name)(config))
    model.save_pretrained(tmp_path / "reference")
    state = {name: t.contiguous().clone() for name, t in model.state_dict().items()}
    assert sum(name.endswith("embed_tokens.weight") for name in state) == 2, sorted(state)
    (tmp_path / "state").mkdir()
    save_file(state, str(tmp_path / "state" / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "state")

    merge(tmp_path / "state", tmp_path / "merged", dtype="float32")
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")
    args = ("--local_dir", str(tmp_path / "state"), "--test_hf_dir", str(tmp_path / "reference"))
    assert "max abs diff 0" in main_stdout("test", *args, "--exact")


DENSE = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**TEXT, "num_hidden_layers": 12}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**TEXT, "num_hidden_layers": 12}),
}


@pytest.mark.parametrize("family", sorted(DENSE))
def test_files_of_a_model_needing_no_mapping_split_as_save_pretrained_splits(tmp_path, family):
    """A model type that needs no mapping is planned without transformers, under the input's
    order; an HF directory's files list tensors by name, so a small split put 27 of 147
    tensors of a 12-layer Qwen2 in other files than save_pretrained. Where the output has
    several files the model gives the order."""
    config_name, class_name, fields = DENSE[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**fields)
    model = randomized(getattr(transformers, class_name)(config))
    model.save_pretrained(tmp_path / "reference", max_shard_size="8KB")
    summary = merge(tmp_path / "reference", tmp_path / "merged", max_shard_size="8KB")
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")
    assert summary.layout.startswith("transformers ")  # asked for the model's order
    # in one file the order does not matter: transformers is not asked
    one = merge(tmp_path / "reference", tmp_path / "one")
    assert one.layout.endswith(f"{family}: needs no mapping (nothing renamed or split)")


def test_without_transformers_a_split_keeps_the_input_order_and_says_so(tmp_path, monkeypatch):
    from shardstream.formats import hf_names_cache

    model = randomized(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT)))
    model.save_pretrained(tmp_path / "reference", max_shard_size="8KB")
    monkeypatch.setattr(hf_names_cache, "transformers_version", lambda: None)
    summary = merge(tmp_path / "reference", tmp_path / "merged", max_shard_size="8KB")
    assert "files split in the input's order" in summary.layout
    merged = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "merged")
    for name, tensor in model.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_names_under_a_training_wrappers_attribute_are_refused_naming_it(tmp_path, family):
    """``state_dict()`` of a module holding the model as ``self.model`` (Lightning-style
    trainers): every name gains "model.". A model type needing no mapping was written as
    stored ("model.model.layers.0...", "model.lm_head.weight": exit 0); every type is refused
    now, naming the prefix, and a DCP checkpoint so saved merges with --prefix."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    if family == "qwen2":
        model = randomized(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT)))
    else:
        model = _model(family)
    model.save_pretrained(tmp_path / "reference")
    wrapped = {f"model.{n}": t.contiguous().clone() for n, t in model.state_dict().items()}
    (tmp_path / "state").mkdir()
    save_file(wrapped, str(tmp_path / "state" / "model.safetensors"))
    model.config.save_pretrained(tmp_path / "state")
    with pytest.raises(CheckpointFormatError, match="every name starts with 'model.'"):
        merge(tmp_path / "state", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    dcp.save(wrapped, checkpoint_id=str(tmp_path / "dcp"))
    config = tmp_path / "state"
    with pytest.raises(CheckpointFormatError, match="--prefix 'model.'"):
        merge(tmp_path / "dcp", tmp_path / "merged", hf_model_path=config)
    merge(tmp_path / "dcp", tmp_path / "merged", hf_model_path=config, prefix="model.",
          dtype="float32")  # fmt: skip
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")
