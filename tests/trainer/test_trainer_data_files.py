"""Real documents (text, JSONL, Parquet) with a tokenizer trained here: reading, per-epoch
shuffled packing, document boundaries, resumable state, config errors naming the field."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.support.data import DOCS, make_tokenizer, write_jsonl, write_parquet, write_text

from overlap_runtime.trainer import (ConfigError, DataStateMismatch, PackedDataset, TextDataset,
                                     build_dataset, config_from_dict)
from overlap_runtime.trainer.documents import load_tokenizer, read_documents, require_extra


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    return {"tokenizer": make_tokenizer(d / "tokenizer.json"),
            "jsonl": write_jsonl(d / "docs.jsonl", field="body"),
            "text": write_text(d / "docs.txt"),
            "parquet": write_parquet(d / "docs.parquet", field="body")}


def _data(paths: dict[str, Path], **fields: Any) -> dict[str, Any]:
    return {"data": {"files": [str(paths["jsonl"])], "text_field": "body",
                     "tokenizer": str(paths["tokenizer"]), "seq_len": 16, **fields}}


def test_the_three_formats_read_the_same_documents(files: dict[str, Path]) -> None:
    texts = {fmt: read_documents(fmt, [files[fmt]], "body") for fmt in ("text", "jsonl",
                                                                         "parquet")}
    assert texts["jsonl"] == texts["parquet"] == DOCS
    # a text block may span lines ("... \nand ..."); blocks split at blank lines
    assert [" ".join(t.split()) for t in texts["text"]] == DOCS
    tok = load_tokenizer(str(files["tokenizer"]))
    cfg = config_from_dict(_data(files)).data
    ds = build_dataset(cfg, dp=1, seed=0)
    assert isinstance(ds, PackedDataset) and ds.num_documents == len(DOCS)
    bos, eos = tok.token_id("<bos>"), tok.token_id("<eos>")
    for d, text in enumerate(DOCS):
        assert ds.documents.document(d).tolist() == [bos] + tok.encode_batch([text])[0] + [eos]
    assert tok.token_id("<unk>") not in ds.documents.tokens.tolist()


def _epoch_stream(ds: PackedDataset, epoch: int) -> list[int]:
    return [t for d in ds.epoch_order(epoch).tolist() for t in ds.documents.document(d).tolist()]


def test_packing_walks_each_epoch_in_its_shuffled_order(files: dict[str, Path]) -> None:
    cfg = config_from_dict(_data(files, batch_size=2)).data
    ds = build_dataset(cfg, dp=2, seed=3)
    L = ds.epoch_tokens
    steps = 2 * L // (4 * 16) + 2
    # the stream read back from the windows: row inputs in order, each window overlapping the
    # next by one token (its last label)
    stream: list[int] = []
    for s in range(steps):
        b = ds.full_batch(s)
        assert b.input_ids.shape == (4, 16) and b.global_tokens == 4 * 16
        assert torch.equal(b.input_ids[:, 1:], b.labels[:, :-1])
        stream += b.input_ids.flatten().tolist()
    assert stream[:2 * L] == _epoch_stream(ds, 0) + _epoch_stream(ds, 1)
    assert ds.epoch_order(0).tolist() != ds.epoch_order(1).tolist()
    assert sorted(ds.epoch_order(1).tolist()) == list(range(len(DOCS)))
    # deterministic from (seed, step); another seed, another order
    again = build_dataset(cfg, dp=2, seed=3)
    assert torch.equal(again.full_batch(5).input_ids, ds.full_batch(5).input_ids)
    assert build_dataset(cfg, dp=2, seed=4).epoch_order(0).tolist() != ds.epoch_order(0).tolist()


def test_rows_carry_their_document_boundaries(files: dict[str, Path]) -> None:
    cfg = config_from_dict(_data(files, batch_size=2)).data
    ds = build_dataset(cfg, dp=2, seed=0)
    eos = load_tokenizer(cfg.tokenizer).token_id("<eos>")
    for s in range(3):
        full = ds.full_batch(s)
        flat = full.input_ids.flatten()
        cu = full.cu_seqlens.tolist()
        # a segment starts at each row start and right after each <eos>, nowhere else
        expected = sorted({r * 16 for r in range(4)} | {
            i + 1 for i in range(flat.numel() - 1) if flat[i] == eos and (i + 1) % 16})
        assert cu == expected + [flat.numel()], (s, cu)
        pos = full.document_position_ids.flatten()
        for a, e in zip(cu[:-1], cu[1:]):
            assert pos[a:e].tolist() == list(range(e - a))
        assert full.max_seqlen == max(e - a for a, e in zip(cu[:-1], cu[1:]))
        assert full.model_kwargs() == {}  # concat: metadata only
        # dp x cp shards tile the full batch; cu_seqlens stays that of the whole rows
        for dp_rank in range(2):
            shards = [ds.rank_batch(s, dp_rank, r, 2) for r in range(2)]
            rows = slice(2 * dp_rank, 2 * dp_rank + 2)
            assert torch.equal(torch.cat([b.input_ids for b in shards], 1),
                               full.input_ids[rows])
            assert torch.equal(torch.cat([b.labels for b in shards], 1), full.labels[rows])
            assert torch.equal(torch.cat([b.document_position_ids for b in shards], 1),
                               full.document_position_ids[rows])
            assert torch.equal(shards[1].position_ids, torch.arange(8, 16))
    reset = build_dataset(cfg.model_copy(update={"packing": "reset_at_document_boundaries"}),
                          dp=2, seed=0).full_batch(0)
    assert torch.equal(reset.position_ids, reset.document_position_ids)
    assert torch.equal(reset.model_kwargs()["cu_seqlens"], reset.cu_seqlens)


def test_default_corpus_windows_mark_each_wrap_as_a_new_document(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("abc")  # stream <bos> a b c <eos>, 5 tokens
    b = TextDataset(seq_len=12, corpus=corpus).full_batch(0)
    flat = b.input_ids[0].tolist()
    starts = [0] + [i for i in range(1, 12) if flat[i] == 257]  # <bos>
    assert b.cu_seqlens.tolist() == starts + [12]


def test_state_resumes_the_position_and_names_what_changed(files: dict[str, Path],
                                                           tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", field="body")
    cfg = config_from_dict(_data(files, files=[str(jsonl)])).data
    ds = build_dataset(cfg, dp=1, seed=0)
    ds.rank_batch(6)
    state = ds.state_dict()
    assert state["next_step"] == 7
    fresh = build_dataset(cfg, dp=1, seed=0)
    fresh.load_state_dict(state)
    assert fresh.position == 7
    with pytest.raises(DataStateMismatch, match=r"seq_len: 16 -> 32"):
        build_dataset(cfg.model_copy(update={"seq_len": 32}), 1, 0).load_state_dict(state)
    with pytest.raises(DataStateMismatch, match=r"packing: 'concat' -> 'reset_at_docu"):
        build_dataset(cfg.model_copy(update={"packing": "reset_at_document_boundaries"}), 1,
                      0).load_state_dict(state)
    other_tok = make_tokenizer(tmp_path / "other.json", DOCS + ["zebra"])
    with pytest.raises(DataStateMismatch, match=r"tokenizer: '[0-9a-f]{64}' -> '[0-9a-f]{64}'"):
        build_dataset(cfg.model_copy(update={"tokenizer": str(other_tok)}), 1,
                      0).load_state_dict(state)
    write_jsonl(jsonl, DOCS + ["one more document"], field="body")
    with pytest.raises(DataStateMismatch, match=rf"files: {jsonl.resolve()} changed \(size"):
        build_dataset(cfg, 1, 0).load_state_dict(state)
    corpus_state = TextDataset(16).state_dict()
    with pytest.raises(DataStateMismatch, match="kind: 'windows' -> 'packed'"):
        fresh.load_state_dict(corpus_state)


def _error(data: dict[str, Any], **top: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"data": data, **top})
    return str(exc.value)


def test_data_config_errors_name_the_field(files: dict[str, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    base = _data(files)["data"]
    assert "data.files[0]='/nope.jsonl': no such file" in _error({**base, "files": ["/nope.jsonl"]})
    odd = tmp_path / "docs.csv"
    odd.write_text("x")
    assert "unknown extension '.csv'" in _error({**base, "files": [str(odd)]})
    assert "data.format" in _error({**base, "format": "csv"})
    assert "data.files mixes formats" in _error(
        {**base, "files": [str(files["jsonl"]), str(files["text"])]})
    assert "data.tokenizer='/nope.json': no such file" in _error({**base,
                                                                  "tokenizer": "/nope.json"})
    assert "data.eos_token='</s>' is not a token of the tokenizer" in _error(
        {**base, "eos_token": "</s>"})
    assert "data.bos_token='<s>' is not a token" in _error({**base, "bos_token": "<s>"})
    assert "exclusive" in _error({**base, "corpus": str(files["text"])})
    assert "data.tokenizer=" in _error({"tokenizer": str(files["tokenizer"])})
    small = _error(base, model={"vocab_size": 8})
    assert f"model.vocab_size=8 is smaller than data.tokenizer={str(files['tokenizer'])!r}" in small
    # reset needs pp == 1; under cp > 1 ring/ulysses attention, either GDN backend (issue #23);
    # on cp == 1 either GDN backend too (one varlen call per layer, issue #22)
    reset = {**base, "packing": "reset_at_document_boundaries"}
    for backend in ("eager", "triton"):
        cfg = config_from_dict({"data": reset, "model": {"gdn_backend": backend}})
        assert cfg.model.gdn_backend == backend and cfg.data.packing == reset["packing"]
    assert "full_attention_cp_mode 'ring' or 'ulysses'" in _error(
        reset, train={"accelerator": {"cp": 2, "full_attention_cp_mode": "all_gather_kv"}})
    for mode in ("p2p", "all_gather", "ulysses", "prefix_scan"):  # prefix_scan: the default
        triton_cp = {"cp": 2, "full_attention_cp_mode": "ring", "linear_attention_cp_mode": mode,
                     "linear_attention_gdn_backend": "triton"}
        no_graph = {"validate_step_graph": False, "check_conformance": False}
        config_from_dict({"data": {**reset, "seq_len": 128},
                          "train": {"accelerator": triton_cp, **no_graph}})
    # the step graph does not describe packed CP messages: validating it is refused by name
    assert "does not describe the packed CP messages" in _error(
        {**reset, "seq_len": 128}, train={"accelerator": {"cp": 2, "full_attention_cp_mode": "ring",
                                                          "linear_attention_cp_mode": "p2p"}})
    assert "got train.accelerator.pp=2" in _error(
        reset, train={"accelerator": {"pp": 2}, "pipeline": {"microbatches": 1}},
        model={"tie_word_embeddings": False})
    # the field exists at load, the text field is checked when the data is read
    cfg = config_from_dict({"data": {**base, "text_field": "nope"}}).data
    with pytest.raises(ValueError, match="data.text_field='nope' is not a field of"):
        build_dataset(cfg, 1, 0)
    # optional packages missing: the error names the extra
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert "pip install overlap_runtime[data]" in _error(base)
    with pytest.raises(ImportError, match=r"pip install overlap_runtime\[data\]"):
        require_extra("datasets", "data.format='jsonl'")
