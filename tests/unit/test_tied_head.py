"""Whether ``lm_head.weight`` is left out, as ``save_pretrained`` leaves it out: decided as the
installed transformers ties the head when it builds the model from the same config.json,
including a config.json that leaves ``tie_word_embeddings`` out because it is the class's
default (transformers 4.x writes no key for a tied Gemma) and vision-language configs whose
text config decides (4.x)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from pretrained_pair import assert_merges_as_saved, state_and_reference
from safetensors.torch import load_file, save_file

from shardstream import merge
from shardstream.commands.inspect import describe
from shardstream.commands.test import compare_with_reference
from shardstream.errors import CheckpointFormatError, UsageError
from shardstream.formats import hf, hf_names, hf_names_cache

transformers = pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, head_dim=8,
)  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2}
VISION.update(out_hidden_size=32, fullatt_block_indexes=[0])


def _vl(tie: bool | None):
    text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2]})
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
    kwargs = {} if tie is None else {"tie_word_embeddings": tie}
    if tie is not None:
        text["tie_word_embeddings"] = tie
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=VISION, **kwargs)


CONFIGS = {
    "gemma-default": lambda: transformers.GemmaConfig(**TEXT),
    "gemma-untied": lambda: transformers.GemmaConfig(**TEXT, tie_word_embeddings=False),
    "qwen2-default": lambda: transformers.Qwen2Config(**TEXT),
    "qwen2-tied": lambda: transformers.Qwen2Config(**TEXT, tie_word_embeddings=True),
    "llama-tied": lambda: transformers.LlamaConfig(**TEXT, tie_word_embeddings=True),
    "qwen2_5_vl-default": lambda: _vl(None),
    "qwen2_5_vl-tied": lambda: _vl(True),
}


def _built_tied(config) -> bool:
    """Whether the model transformers builds from ``config`` shares one head and embedding."""
    auto = transformers.AutoModelForImageTextToText
    if not hasattr(config, "text_config"):
        auto = transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _saved_config(config, tmp_path) -> dict:
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_config_json_ties_as_the_built_model(case, tmp_path):
    config = CONFIGS[case]()
    saved = _saved_config(config, tmp_path)
    assert hf.ties_word_embeddings(saved) is _built_tied(config)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_live_config_ties_as_the_built_model(case):
    config = CONFIGS[case]()
    assert hf.ties_word_embeddings(config.to_dict(), config) is _built_tied(config)


def test_without_transformers_an_explicit_key_decides_and_a_missing_one_is_refused(
    monkeypatch,
):
    monkeypatch.setattr(hf_names_cache, "transformers_version", lambda: None)
    assert hf.ties_word_embeddings({"model_type": "qwen2", "tie_word_embeddings": False}) is False
    assert hf.ties_word_embeddings({"model_type": "llama", "tie_word_embeddings": True}) is True
    for model_type in ("gemma", "a-model-transformers-lacks"):
        with pytest.raises(UsageError, match=f"'{model_type}'.*pip install transformers"):
            hf.ties_word_embeddings({"model_type": model_type})


def test_a_model_type_transformers_lacks_keeps_the_head():
    """Remote code: the class is not installed, and leaving out an untied head loses it."""
    assert hf.ties_word_embeddings({"model_type": "a-model-transformers-lacks"}) is False


def _gemma_state_dir(tmp_path, drop_key: bool = True):
    """A Gemma's full state (head and embedding both named) and its config.json, the key
    left out as transformers 4.x leaves it out; and the save_pretrained reference."""
    torch.manual_seed(0)
    return _state_dir(tmp_path, transformers.GemmaForCausalLM(transformers.GemmaConfig(**TEXT)),
                      drop_key)  # fmt: skip


def _state_dir(tmp_path, model, drop_key: bool = False):
    """``pretrained_pair.state_and_reference``, config.json without ``tie_word_embeddings``
    when ``drop_key``."""
    return state_and_reference(
        tmp_path, model, (lambda c: c.pop("tie_word_embeddings", None)) if drop_key else None
    )


def test_without_transformers_merge_refuses_an_undecided_head_and_writes_nothing(
    tmp_path, monkeypatch
):
    source, reference, _ = _gemma_state_dir(tmp_path)
    monkeypatch.setattr(hf_names_cache, "transformers_version", lambda: None)
    with pytest.raises(UsageError, match="config.json: no 'tie_word_embeddings'.*'gemma'"):
        merge(source, tmp_path / "merged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference", "state"]
    info = describe(source)
    assert "tie_word_embeddings" in info["merge"]["layout"]["refused"]
    merge(source, tmp_path / "forced", tie_word_embedding=True)  # the user decides
    got, want = (
        load_file(tmp_path / "forced" / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_merge_leaves_out_a_head_tied_by_the_class_default(tmp_path):
    """A Gemma config.json without ``tie_word_embeddings`` (as transformers 4.x writes it):
    the built model is tied, so save_pretrained writes the embedding alone; so must merge."""
    source, reference, state = _gemma_state_dir(tmp_path)
    assert "lm_head.weight" in state
    assert "lm_head.weight" not in load_file(reference / "model.safetensors")
    assert_merges_as_saved(source, reference, tmp_path / "merged")


def test_resolving_through_transformers_prints_nothing(tmp_path):
    """transformers' own warnings about the config (a token id beyond the tiny vocabulary)
    are not the merge's to print."""
    saved = _saved_config(_vl(None), tmp_path)
    saved["text_config"]["eos_token_id"] = TEXT["vocab_size"] + 4321  # a message not seen yet
    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.WARNING)
    keep.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(keep)
    try:
        hf.ties_word_embeddings(saved)
    finally:
        logger.removeHandler(keep)
    assert [r.getMessage() for r in records] == []


SMALL = {"vocab_size": 64, "hidden_size": 32}
OTHER_EMBEDDINGS = {  # tied heads whose embedding is not named *embed_tokens.weight
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    ),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            **SMALL,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            tie_word_embeddings=True,
        )
    ),  # fmt: skip
    "mamba": lambda: transformers.MambaForCausalLM(
        transformers.MambaConfig(**SMALL, num_hidden_layers=1, state_size=4)
    ),
}


@pytest.mark.parametrize("family", sorted(OTHER_EMBEDDINGS))
def test_a_head_tied_to_another_embedding_is_left_out(tmp_path, family):
    """GPT-2's transformer.wte, GPT-NeoX's gpt_neox.embed_in, Mamba's backbone.embeddings:
    the model class names the pair it ties, and save_pretrained writes the embedding alone."""
    torch.manual_seed(0)
    model = OTHER_EMBEDDINGS[family]()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    source, reference, _ = _state_dir(tmp_path, model)
    assert_merges_as_saved(source, reference, tmp_path / "merged")


def test_the_flag_does_not_drop_a_head_the_config_unties(tmp_path, caplog):
    """--tie-word-embedding dropped lm_head.weight though config.json said
    tie_word_embeddings false: transformers then loaded a newly initialised head. verl's FSDP
    merger ignores the flag (it is for Megatron checkpoints)."""
    config = transformers.Qwen2Config(**TEXT, tie_word_embeddings=False)
    source, reference, _ = _state_dir(tmp_path, transformers.Qwen2ForCausalLM(config))
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        merge(source, tmp_path / "merged", tie_word_embedding=True)
    got, want = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert "lm_head.weight" in want and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert "--tie-word-embedding ignored" in caplog.text


@pytest.mark.parametrize(
    "architecture, written", [("Qwen2ForCausalLM", True), ("Qwen2ForTokenClassification", False)]
)
def test_generation_config_only_for_a_model_that_generates(tmp_path, architecture, written):
    """The hf_model export wrote generation_config.json for a critic, whose class cannot
    generate; save_pretrained (and verl) write none for it."""
    config = transformers.Qwen2Config(**TEXT, architectures=[architecture], num_labels=1)
    hf.write_configs(tmp_path, "F32", hf_config=config)
    assert (tmp_path / "config.json").is_file()
    assert (tmp_path / "generation_config.json").is_file() == written


@pytest.mark.parametrize(
    "architecture, written", [("Qwen2ForCausalLM", True), ("Qwen2ForTokenClassification", False)]
)
def test_generation_config_derived_only_where_the_source_has_none(tmp_path, architecture, written):
    """A copied config dir without generation_config.json gets save_pretrained's derived one
    for a model that generates; one the source holds is copied unchanged."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir(), target.mkdir()
    config = transformers.Qwen2Config(**TEXT, architectures=[architecture], num_labels=1)
    config.save_pretrained(source)
    hf.write_configs(target, "F32", source)
    assert (target / "generation_config.json").is_file() == written
    own = {"do_sample": True, "temperature": 0.25}
    (source / "generation_config.json").write_text(json.dumps(own))
    hf.write_configs(target, "F32", source)
    assert json.loads((target / "generation_config.json").read_text()) == own


def test_generation_config_not_derivable_is_said(tmp_path, caplog):
    """A model type transformers does not know: no generation_config.json, and the log names
    the directory and why."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir(), target.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    with caplog.at_level(logging.WARNING):
        hf.write_configs(target, "F32", source)
    assert not (target / "generation_config.json").exists()
    assert str(source) in caplog.text and "no_such_model_type" in caplog.text


def _with_head_apart(source, state) -> None:
    """Store a head that differs from the embedding in one element, as a run that untied them
    trains it."""
    head = state["model.embed_tokens.weight"].clone()
    head[-1, -1] += 1.0
    save_file(dict(state, **{"lm_head.weight": head}), str(source / "model.safetensors"))


@pytest.mark.parametrize("drop_key", [True, False], ids=["class-default", "explicit"])
def test_a_head_trained_apart_from_a_tied_embedding_is_refused(tmp_path, drop_key):
    """config.json ties the head (explicitly, or by Gemma's class default where the key is
    left out), but the stored head differs from the embedding: save_pretrained's layout would
    lose it, and the model loaded from the output would use the embedding instead."""
    source, reference, state = _gemma_state_dir(tmp_path, drop_key)
    assert compare_with_reference(source, reference, exact=True).ok
    _with_head_apart(source, state)
    report = compare_with_reference(source, reference, exact=True)
    assert not report.ok
    assert [p for p in report.problems if "lm_head" in p] == [
        "tensor 'lm_head.weight': differs from 'model.embed_tokens.weight', but the reference "
        "ties the output head to the input embedding (it holds no head), so its model's head "
        "is not the checkpoint's"
    ]
    said = "by its class's default" if drop_key else "ties the output head"
    with pytest.raises(
        CheckpointFormatError,
        match=f"'lm_head.weight' differs from 'model.embed_tokens.weight'.*{said}.*--hf_model_path",
    ):
        merge(source, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    untied = tmp_path / "untied"  # the run's own config: the head is written
    untied.mkdir()
    config = json.loads((source / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    merge(source, tmp_path / "merged", hf_model_path=untied)
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert torch.equal(
        got["lm_head.weight"], load_file(source / "model.safetensors")["lm_head.weight"]
    )


def test_a_head_saved_as_its_embeddings_storage_is_not_read(tmp_path):
    """torch.save writes a tied model's one storage once, under both names (verl's rank
    files): the head is its embedding, told from the blocks, without reading a byte. A head
    stored apart is read to be compared."""
    from shardstream.commands.merge import heads_trained_apart
    from shardstream.engine.copy import Buffers, Streamer
    from shardstream.engine.plan import GlobalTensor, dense_block

    def opened(location):
        raise AssertionError(f"read {location}")

    config = {"model_type": "qwen2", "tie_word_embeddings": True}
    embedding = dense_block(str(tmp_path / "rank0.pt"), 64, "F32", (8, 4))
    head = dense_block(str(tmp_path / "rank0.pt"), 192, "F32", (8, 4))
    streamer = Streamer(opened, Buffers.sized(1 << 16))
    for head_block, reads in ((embedding, False), (head, True)):
        tensors = [
            GlobalTensor("model.embed_tokens.weight", "F32", (8, 4), (embedding,)),
            GlobalTensor("lm_head.weight", "F32", (8, 4), (head_block,)),
        ]
        found = heads_trained_apart({"lm_head.weight"}, tensors, config, "BF16", streamer)
        if reads:
            with pytest.raises(AssertionError, match="read .*rank0.pt"):
                list(found)
        else:
            assert list(found) == []


def test_a_head_that_is_the_only_copy_of_its_tied_pair_is_written(tmp_path):
    """BLT's class ties its byte embedding to the head ({embedding: head}), so save_pretrained
    writes lm_head.weight alone, and beside it another embedding of the head's shape (the
    patcher's). merge compared the head with that one and refused the model as trained apart
    (before that, it left out the only copy)."""
    small = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    small.update(intermediate_size=32, num_hidden_layers=1, vocab_size=64)
    config = transformers.BltConfig(
        vocab_size=64,
        encoder_hash_byte_group_vocab=32,
        tie_word_embeddings=True,
        patcher_config=dict(small, head_dim=8),
        encoder_config=dict(small, hidden_size_global=32),
        decoder_config=dict(small, hidden_size_global=32, head_dim=8),
        global_config=dict(small, hidden_size=32, head_dim=16),
    )
    torch.manual_seed(0)
    model = transformers.BltForCausalLM(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "reference")
    saved = load_file(tmp_path / "reference" / "model.safetensors")
    if hf_names.has_weight_conversions():  # 5.x keeps the head's name; 4.x the embedding's
        assert "lm_head.weight" in saved and "model.local_encoder.embed_tokens.weight" not in saved
    assert_merges_as_saved(tmp_path / "reference", tmp_path / "reference", tmp_path / "merged")


T5 = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
ALIASED = {  # a model, the alias save_pretrained leaves out, and the tensor it writes for it
    "t5": (
        lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)),
        "decoder.embed_tokens.weight",
        "shared.weight",
    ),
    "bert": (
        lambda: transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=64,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=32,
            )  # fmt: skip
        ),
        "cls.predictions.decoder.weight",
        "bert.embeddings.word_embeddings.weight",
    ),
}


@pytest.mark.parametrize("family", sorted(ALIASED))
def test_an_alias_trained_apart_from_what_is_written_is_refused(tmp_path, family):
    """The layout leaves out a stored tensor the model answers to under another name as well
    (T5's decoder.embed_tokens is its shared embedding; BERT's decoder its word embeddings):
    one that holds other values than the written one would be lost, so merge refuses it,
    naming both, and writes nothing. Equal values are left out as save_pretrained does."""
    build, alias, written = ALIASED[family]
    torch.manual_seed(0)
    source, reference, state = _state_dir(tmp_path, build(), drop_key=True)
    assert alias in state and alias not in load_file(reference / "model.safetensors")
    assert_merges_as_saved(source, reference, tmp_path / "merged")
    assert compare_with_reference(source, reference, exact=True).ok
    apart = state[alias].clone()
    apart[0, 0] += 1.0
    save_file(dict(state, **{alias: apart}), str(source / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=f"'{alias}' differs from '{written}'"):
        merge(source, tmp_path / "apart")
    report = compare_with_reference(source, reference, exact=True)  # shardstream test
    assert not report.ok
    assert any(p.startswith(f"tensor {alias!r}: differs from") for p in report.problems)
    assert not (tmp_path / "apart").exists()
    if family == "t5":  # BERT's decoder is a head config.json ties: refused with the names kept
        merge(source, tmp_path / "kept", keep_names=True)  # every stored tensor, on purpose
        assert torch.equal(load_file(tmp_path / "kept" / "model.safetensors")[alias], apart)


def test_a_plan_names_the_aliases_it_leaves_out_and_caches_them(tmp_path, monkeypatch):
    """``NamePlan.aliases`` pairs each stored alias left out with the stored tensor written
    for it; a plan read back from the layout cache says the same."""
    monkeypatch.setenv(hf_names_cache.ENV, str(tmp_path / "cache"))
    config = transformers.T5Config(**T5)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    stored = [(n, "F32", tuple(t.shape)) for n, t in model.state_dict().items()]
    stored = [t for t in stored if t[0] != "lm_head.weight"]
    want = (
        ("decoder.embed_tokens.weight", "shared.weight"),
        ("encoder.embed_tokens.weight", "shared.weight"),
    )
    computed = hf_names._plan_names(tuple(stored), saved)
    assert computed.aliases == want
    assert not {a for a, _ in want} & {p.stored for p in computed.pieces}
    assert hf_names_cache.load(tuple(stored), saved) is not None
    assert hf_names._plan_names(tuple(stored), saved).aliases == want  # from the cache


def test_a_head_equal_to_another_tensor_of_its_shape_is_not_tied_to_it(tmp_path):
    """A Qwen2 whose intermediate_size is its vocab_size: a head trained apart from its tied
    embedding that happens to equal layer 0's gate_proj passed the check (compared with every
    tensor of its shape) and was left out; it is compared with its embedding alone."""
    sizes = dict(TEXT, intermediate_size=64)  # = vocab_size: gate_proj is [64, 32] like the head
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**sizes, tie_word_embeddings=True)
    )
    source, _, state = _state_dir(tmp_path, model)
    gate = state["model.layers.0.mlp.gate_proj.weight"]
    assert gate.shape == state["model.embed_tokens.weight"].shape
    save_file(dict(state, **{"lm_head.weight": gate.clone()}), str(source / "model.safetensors"))
    with pytest.raises(
        CheckpointFormatError,
        match="'lm_head.weight' differs from 'model.embed_tokens.weight', but",
    ):
        merge(source, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_without_a_config_json_the_flag_decides(tmp_path, caplog):
    """No config.json anywhere (weights alone): nothing says whether the head is tied, so
    --tie-word-embedding does, as the README says; it was ignored with a warning citing the
    model's config. A head that is not the embedding's copy is still refused."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TEXT, tie_word_embeddings=True)
    )
    source, _, state = _state_dir(tmp_path, model)
    (source / "config.json").unlink()
    merge(source, tmp_path / "kept")
    assert "lm_head.weight" in load_file(tmp_path / "kept" / "model.safetensors")
    merge(source, tmp_path / "tied", tie_word_embedding=True)
    written = load_file(tmp_path / "tied" / "model.safetensors")
    assert "lm_head.weight" not in written
    assert "--tie-word-embedding ignored" not in caplog.text
    _with_head_apart(source, state)
    with pytest.raises(CheckpointFormatError, match="'lm_head.weight' differs from"):
        merge(source, tmp_path / "apart", tie_word_embedding=True)


@pytest.mark.parametrize("value", ["true", 1, None], ids=["string", "number", "null"])
def test_a_tie_word_embeddings_that_is_not_a_boolean_is_refused(value):
    """``"tie_word_embeddings": "true"`` was taken as set and merged exit 0 into an output
    transformers does not load; null is the key left out."""
    config = {"model_type": "qwen2", "tie_word_embeddings": value}
    if value is None:
        assert hf.ties_word_embeddings(config) is False  # Qwen2's default
        return
    with pytest.raises(CheckpointFormatError, match="tie_word_embeddings is .*, not true or false"):
        hf.ties_word_embeddings(config)


def test_an_integer_head_is_not_taken_for_its_float_embeddings_copy(tmp_path):
    """An all-zero int32 head beside a float embedding cast to int32 for the comparison, and
    an embedding of small values came out as zeros too: the head was left out as tied."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TEXT, tie_word_embeddings=True)
    )
    source, _, state = _state_dir(tmp_path, model)
    head = torch.zeros_like(state["model.embed_tokens.weight"], dtype=torch.int32)
    save_file(dict(state, **{"lm_head.weight": head}), str(source / "model.safetensors"))
    with pytest.raises(
        CheckpointFormatError, match="'lm_head.weight' has the shape of no other integer tensor"
    ):
        merge(source, tmp_path / "merged")


def test_a_head_trained_apart_is_named_in_the_rank_file_whose_shard_differs(tmp_path):
    """A tied head sharded like its embedding across two rank files, where only rank 1's
    shard differs: the refusal named rank 0's file, which holds the equal half."""
    import numpy as np

    from shardstream.commands.merge import differing_file, heads_trained_apart
    from shardstream.engine.copy import Buffers, Streamer
    from shardstream.engine.endpoints import OpenEndpoints
    from shardstream.engine.plan import GlobalTensor, dense_block

    embedding = np.arange(32, dtype=np.float32).reshape(8, 4)
    head = embedding.copy()
    head[6, 1] += 1.0  # a row of rank 1's half
    files = [tmp_path / f"model_world_size_2_rank_{r}.pt" for r in (0, 1)]
    for rank, file in enumerate(files):
        rows = slice(4 * rank, 4 * rank + 4)
        file.write_bytes(embedding[rows].tobytes() + head[rows].tobytes())

    def halves(offset):
        return tuple(
            dense_block(str(f), offset, "F32", (4, 4), (4 * r, 0)) for r, f in enumerate(files)
        )

    tensors = [
        GlobalTensor("model.embed_tokens.weight", "F32", (8, 4), halves(0)),
        GlobalTensor("lm_head.weight", "F32", (8, 4), halves(64)),
    ]
    config = {"model_type": "qwen2", "tie_word_embeddings": True}
    endpoints = OpenEndpoints()
    try:
        streamer = Streamer(endpoints, Buffers.sized(1 << 16))
        ((found, said, source),) = heads_trained_apart(
            {"lm_head.weight"}, tensors, config, None, streamer
        )
        assert (found.name, source.name) == ("lm_head.weight", "model.embed_tokens.weight")
        assert "differs from 'model.embed_tokens.weight'" in said
        assert differing_file(found, source, streamer) == str(files[1])
        assert differing_file(source, source, streamer) == str(files[0])  # none differs
    finally:
        endpoints.close()
