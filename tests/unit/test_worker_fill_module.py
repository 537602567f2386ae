"""``worker.loader.fill_module`` / ``empty_weights``: modules built without parameter storage get
the checkpoint's tensors, and their non-persistent buffers keep the constructor's values.

Plus ``worker.hf`` without a cluster (needs transformers; skipped without it): config from
``config.json`` bytes, key matching, tied weights, the serve request contract, and
``load_pretrained``'s reading of ``config.json`` through ``paramserver.client.folder.read_file``.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from worker.loader import FillError, check_fillable, empty_weights, fill_module, load_into

CPU = torch.device("cpu")


class Positions(torch.nn.Module):
    """A non-persistent buffer (like BERT's position_ids), a persistent one, and a tied head."""

    def __init__(self, n: int = 10, d: int = 4) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(n, d)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, n, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("position_ids", torch.arange(n).expand(1, -1) * 3 + 1, persistent=False)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.position_ids[:, : ids.shape[1]]
        return self.head(self.norm(self.emb(ids) + self.emb(pos % self.emb.num_embeddings)) * self.scale)


def reference() -> tuple[Positions, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ref = Positions().eval()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)
        ref.scale.fill_(2.0)  # a persistent buffer: the checkpoint's value must win over the constructor's
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}  # tied: saved once
    return ref, sd


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers() -> None:
    original = torch.nn.Module.register_parameter
    with empty_weights():
        m = Positions()
        with empty_weights():  # nests
            inner = torch.nn.Linear(2, 2)
    assert all(p.is_meta for p in m.parameters()) and inner.weight.is_meta
    assert m.head.weight is m.emb.weight  # ties made in the constructor survive
    assert torch.equal(m.position_ids, torch.arange(10).expand(1, -1) * 3 + 1)
    assert torch.equal(m.scale, torch.full((4,), 0.5))
    assert m.emb.weight.requires_grad and type(m.emb.weight) is torch.nn.Parameter
    after = torch.nn.Linear(2, 2)  # the patch is gone once the block ends
    assert not after.weight.is_meta
    assert torch.nn.Module.register_parameter is original


def test_empty_weights_is_per_thread() -> None:
    inside, built = threading.Event(), threading.Event()
    other: list[torch.nn.Module] = []

    def build_elsewhere() -> None:
        inside.wait(10)
        other.append(torch.nn.Linear(3, 3))
        built.set()

    t = threading.Thread(target=build_elsewhere)
    t.start()
    with empty_weights():
        inside.set()
        assert built.wait(10)
        mine = torch.nn.Linear(3, 3)
    t.join(10)
    assert mine.weight.is_meta and not other[0].weight.is_meta


def test_fill_gives_checkpoint_values_and_constructor_buffers() -> None:
    ref, sd = reference()
    with empty_weights():
        m = Positions()
    report = fill_module(m, sd, CPU)
    m.eval()
    assert torch.equal(m.position_ids, torch.arange(10).expand(1, -1) * 3 + 1)  # the constructor's values
    assert torch.equal(m.scale, torch.full((4,), 2.0))  # the checkpoint's
    assert m.head.weight is m.emb.weight and m.emb.weight.data_ptr() == sd["emb.weight"].data_ptr()  # no copy, still tied
    assert report.tied == (("head.weight", "emb.weight"),) and not report.recomputed and not report.missing
    assert not any(t.is_meta for t in (*m.parameters(), *m.buffers()))
    assert torch.equal(m(IDS), ref(IDS))


def test_checkpoint_position_ids_are_skipped_not_fatal_even_strict() -> None:
    ref, sd = reference()
    sd["position_ids"] = torch.zeros(1, 10, dtype=torch.long) - 7  # an old checkpoint's copy: not used
    with empty_weights():
        m = Positions()
    report = fill_module(m, sd, CPU, strict=True)
    assert report.recomputed == ("position_ids",)
    assert torch.equal(m.position_ids, torch.arange(10).expand(1, -1) * 3 + 1)
    assert torch.equal(m.eval()(IDS), ref(IDS))


def test_meta_module_with_nonpersistent_buffers_is_refused_with_the_fix() -> None:
    _, sd = reference()
    with torch.device("meta"):
        m = Positions()
    with pytest.raises(FillError, match=r"position_ids.*empty_weights\(\)"):
        fill_module(m, sd, CPU)
    assert all(p.is_meta for p in m.parameters())  # nothing changed
    with pytest.raises(FillError, match="empty_weights"):
        check_fillable(m)
    # load_into refuses before it touches the cluster (nothing listens on this port)
    with pytest.raises(FillError, match="empty_weights"):
        load_into(m, "127.0.0.1:9", "m:prod")


def test_meta_module_without_nonpersistent_buffers_still_loads() -> None:
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).eval()
    with torch.no_grad():
        ref[1].running_mean.uniform_()
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    fill_module(m, ref.state_dict(), CPU)
    x = torch.randn(3, 6)
    assert torch.equal(m.eval()(x), ref(x))


def test_unexpected_key_is_an_error_under_strict_and_reported_otherwise() -> None:
    _, sd = reference()
    sd["extra.weight"] = torch.ones(2)
    with empty_weights():
        m = Positions()
    with pytest.raises(FillError, match="extra.weight"):
        fill_module(m, sd, CPU)
    assert m.emb.weight.is_meta  # refused before anything was assigned
    report = fill_module(m, sd, CPU, strict=False)
    assert report.unexpected == ("extra.weight",) and not m.emb.weight.is_meta


def test_missing_parameter_is_an_error_naming_it_even_without_strict() -> None:
    _, sd = reference()
    del sd["norm.bias"]
    for strict in (True, False):
        with empty_weights():
            m = Positions()
        with pytest.raises(FillError, match=r"norm\.bias"):
            fill_module(m, sd, CPU, strict=strict)
    # a tied pair needs only one of its names, whichever it is
    _, sd = reference()
    sd["head.weight"] = sd.pop("emb.weight")
    with empty_weights():
        m = Positions()
    report = fill_module(m, sd, CPU)
    assert m.emb.weight is m.head.weight and report.tied == (("emb.weight", "head.weight"),)
    # both names gone: an error naming them
    _, sd = reference()
    del sd["emb.weight"]
    with empty_weights():
        m = Positions()
    with pytest.raises(FillError, match=r"emb\.weight.*head\.weight|head\.weight.*emb\.weight"):
        fill_module(m, sd, CPU, strict=False)


def test_a_missing_parameter_is_always_an_error_a_missing_buffer_only_under_strict() -> None:
    _, sd = reference()
    del sd["scale"]  # a persistent buffer
    m = Positions()
    with pytest.raises(FillError, match="scale"):
        fill_module(m, sd, CPU)
    report = fill_module(m, sd, CPU, strict=False)
    assert report.missing == ("scale",) and torch.equal(m.scale, torch.full((4,), 0.5))
    _, sd = reference()
    del sd["norm.bias"]  # a parameter: never left as built, whatever strict says
    for strict in (True, False):
        with pytest.raises(FillError, match="parameter.*norm.bias"):
            fill_module(Positions(), sd, CPU, strict=strict)


def test_tied_names_that_differ_in_the_checkpoint_are_refused() -> None:
    _, sd = reference()
    sd["head.weight"] = sd["emb.weight"].clone()  # equal: fine, still one tensor
    with empty_weights():
        m = Positions()
    fill_module(m, sd, CPU)
    assert m.head.weight is m.emb.weight
    sd["head.weight"] = sd["emb.weight"] + 1
    with empty_weights():
        m = Positions()
    with pytest.raises(FillError, match="tied"):
        fill_module(m, sd, CPU)


def test_shape_mismatch_is_an_error() -> None:
    _, sd = reference()
    sd["norm.weight"] = torch.ones(5)
    with empty_weights():
        m = Positions()
    with pytest.raises(RuntimeError, match="norm.weight"):
        fill_module(m, sd, CPU)


# ---------------------------------------------------------------------- worker.hf without a cluster

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)


def _bert(tf: Any, head: bool = False) -> tuple[Any, dict[str, torch.Tensor], bytes]:
    torch.manual_seed(0)
    config = tf.BertConfig(**BERT)
    model = (tf.BertForPreTraining if head else tf.BertModel)(config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if head:  # tied to the word embeddings and the head's bias: saved once
        sd.pop("cls.predictions.decoder.weight")
        sd.pop("cls.predictions.decoder.bias", None)
    return model, sd, json.dumps(config.to_dict()).encode()


def test_hf_base_and_head_checkpoints_cross_load() -> None:
    tf = pytest.importorskip("transformers")
    from worker.hf import build_model, config_from_json, fill_pretrained, map_keys

    ref, sd, raw = _bert(tf, head=True)
    sd["bert.embeddings.position_ids"] = torch.arange(512).expand(1, -1)  # as older checkpoints carry it
    base = build_model(config_from_json(raw))  # AutoModel: the base model
    assert type(base).__name__ == "BertModel" and all(p.is_meta for p in base.parameters())
    keys = map_keys(base, list(sd))
    assert keys.rename["bert.embeddings.word_embeddings.weight"] == "embeddings.word_embeddings.weight"
    assert "cls.predictions.bias" in keys.skipped  # the head's weights are not the base model's
    fill_pretrained(base, sd, CPU, keys)
    x = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        assert torch.equal(base(x).last_hidden_state, ref.bert(x).last_hidden_state)
    assert not base.training

    # the other way: a base checkpoint into the model with a head (tied decoder from the embeddings)
    head = build_model(config_from_json(raw, tf.BertForPreTraining), tf.BertForPreTraining)
    base_sd = {k.removeprefix("bert."): v for k, v in sd.items() if k.startswith("bert.")}
    base_sd.update({k: v for k, v in sd.items() if k.startswith("cls.")})
    fill_pretrained(head, base_sd, CPU)
    assert head.cls.predictions.decoder.weight is head.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        assert torch.equal(head(x).prediction_logits, ref(x).prediction_logits)


def test_hf_unknown_key_is_an_error() -> None:
    tf = pytest.importorskip("transformers")
    from worker.hf import build_model, config_from_json, fill_pretrained

    _, sd, raw = _bert(tf)
    sd["pooler.extra.weight"] = torch.ones(2)
    with pytest.raises(FillError, match="pooler.extra.weight"):
        fill_pretrained(build_model(config_from_json(raw)), sd, CPU)


def test_hf_serving_contract() -> None:
    tf = pytest.importorskip("transformers")
    from worker.hf import HFServing

    ref, _, _ = _bert(tf)
    serving = HFServing()
    out = serving.forward(ref, {"input": [[1, 2, 3]], "attention_mask": [[1, 1, 0]]}, CPU)
    assert out["output_name"] == "last_hidden_state" and len(out["output"][0]) == 3 and len(out["output"][0][0]) == 32
    for bad in ({"input": [[1.5, 2]]}, {"input": [1, 2]}, {"input": [[1, 2], [3]]},
                {"input": [[1, 2]], "attention_mask": [[1]]}):
        with pytest.raises(ValueError):
            serving.forward(ref, bad, CPU)
    assert serving.name == "hf:AutoModel" and HFServing("AutoModelForCausalLM").name == "hf:AutoModelForCausalLM"
    from worker.errors import ConfigError

    with pytest.raises(ConfigError):
        HFServing("NoSuchModel").check()


def test_load_pretrained_reads_config_through_folder_read_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster side stubbed: the manifest's files name config.json, ``read_file`` serves it,
    and ``load`` hands back the checkpoint's tensors."""
    tf = pytest.importorskip("transformers")
    import types

    from chunking.manifest import FileEntry
    from worker import hf
    from worker.loader import LoadedModel

    ref, sd, raw = _bert(tf)
    reads: list[str] = []
    manifest = types.SimpleNamespace(
        model="bert", files=(FileEntry("config.json", len(raw), "0" * 64, ()),),
        tensors=[types.SimpleNamespace(name=n) for n in sd],
    )
    client = types.SimpleNamespace(manifest=lambda _id: manifest)
    info = types.SimpleNamespace(manifest_id="m", model="bert", number=1)

    def read_file(_client: Any, _manifest: Any, path: str) -> bytes:
        reads.append(path)
        return raw

    monkeypatch.setattr(hf, "client_for", lambda cluster, token=None: (cluster, False))
    monkeypatch.setattr(hf, "resolve_ref", lambda _c, _r: info)
    monkeypatch.setattr(hf, "load", lambda *a, **k: LoadedModel(sd, manifest, info, None, None))  # type: ignore[arg-type]
    from paramserver.client import folder

    monkeypatch.setattr(folder, "read_file", read_file)
    model = hf.load_pretrained(client, "bert:prod")
    assert reads == ["config.json"] and not model.training
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, ref(x).last_hidden_state)

    from paramserver.client.errors import NotFound

    manifest.files = ()
    with pytest.raises(NotFound, match="folder"):
        hf.load_pretrained(client, "bert:prod")


def test_empty_weights_skips_initialising_meta_parameters_only() -> None:
    import torch.nn.init as init

    before = init.normal_
    real = torch.zeros(3)
    with empty_weights():
        assert init.normal_ is not before  # patched while active
        emb = torch.nn.Embedding(8, 4)  # its reset_parameters calls init.normal_ on a meta weight: a no-op
        assert emb.weight.is_meta
        init.normal_(real)  # a real tensor is still initialised
    assert init.normal_ is before  # restored
    assert not torch.equal(real, torch.zeros(3))
