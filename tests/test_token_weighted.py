"""The token-weighted objective (train.loss_average "tokens", the HF Trainer's since 4.46): a
step's loss is the sum of its token losses over every micro-batch and rank divided by its label
tokens, so per-step losses, gradient norms and weights do not depend on how the step's samples are
split into micro-batches, accumulation steps and ranks; it equals the HF Trainer at its defaults;
train.loss_average "micro_batch" equals the HF Trainer forced to per-micro-batch means.

Every run trains the same 6 steps of 4 uneven samples (input/output rows: the prompt is not a
target, so the target counts differ from row to row) on a tiny fp32 Llama, through
tests/scripts/token_weighted.py; one 1-rank launch and one 2-rank launch for the whole file.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dist_utils import SCRIPTS, run_deepspeed

pytestmark = pytest.mark.slow  # engine processes: the slow tier

# fp32 on CPU: the splits reorder sums; what is left is rounding
LOSS_TOL, NORM_TOL, WEIGHT_TOL = 2e-6, 2e-5, 1e-6

ONE_RANK = {
    "a4": "batch_size=1,train.grad_accum=4,zero_stage=2",
    "b1": "batch_size=4,train.grad_accum=1,zero_stage=2",
    "m4": "batch_size=1,train.grad_accum=4,zero_stage=2,train.loss_average=micro_batch",
    "l4": "method=lomo,batch_size=4",
    "c4": "batch_size=1,train.grad_accum=4,zero_stage=2,train.logits_chunk_rows=3",  # the cross-entropy in chunks
}
HF = "hf4:1:4;hfm4:1:4:mean"  # the HF Trainer: micro 1 x accumulation 4, default and forced means
TWO_RANKS = {  # the pipeline last: a data-parallel engine built after DeepSpeed's pipeline fails
    "l2": "method=lomo,batch_size=2",
    "z0": "zero_stage=0,batch_size=1,train.grad_accum=2",
    "z2": "zero_stage=2,batch_size=1,train.grad_accum=2",
    "z3": "zero_stage=3,batch_size=1,train.grad_accum=2",
    "z3c": "zero_stage=3,batch_size=1,train.grad_accum=2,train.logits_chunk_rows=3",
    "tpc": "parallel.tp_size=2,batch_size=1,train.grad_accum=4,train.logits_chunk_rows=3",
    "ppa": "parallel.pp_size=2,batch_size=1,train.grad_accum=4",
    "ppb": "parallel.pp_size=2,batch_size=4,train.grad_accum=1",
    "ppe": "parallel.pp_size=2,batch_size=1,train.grad_accum=4,train.logits_at_labels=false",
    "ppc": "parallel.pp_size=2,batch_size=1,train.grad_accum=4,train.logits_chunk_rows=3",
}


def write_inputs(work) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.data.default_task import ensure_default_assets
    from engine.model.loading import load_tokenizer
    assets = ensure_default_assets(work / "assets")
    tok = load_tokenizer(assets.model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    rows = [json.loads(line) for line in assets.train_path.read_text().splitlines()[:64]]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def launch(work, nproc: int, runs: dict[str, str], hf: str = "") -> None:
    spec = ";".join(f"{name}:{overrides}{',nproc=2' if nproc == 2 else ''}" for name, overrides in runs.items())
    run_deepspeed(SCRIPTS / "token_weighted.py", nproc=nproc, args=("--work", str(work), "--runs", spec, "--hf", hf),
                  timeout=600)


def load(work, name: str) -> dict:
    return torch.load(work / f"{name}.pt", weights_only=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("token-weighted")
    write_inputs(work)
    launch(work, 1, ONE_RANK, HF)
    return work


def same_run(got: dict, ref: dict, weights: bool = True, norms: bool = True) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 6
    assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL), list(zip(got["losses"], ref["losses"]))
    if norms:
        assert not any(math.isnan(n) for n in got["norms"] + ref["norms"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=NORM_TOL), list(zip(got["norms"], ref["norms"]))
    if weights:
        assert got["weights"].keys() == ref["weights"].keys()
        for key, value in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=0, atol=WEIGHT_TOL, msg=key)


def test_accumulation_invariance_one_rank(work):
    """micro 1 x accumulation 4 == micro 4 x accumulation 1: losses, grad norms, weights."""
    same_run(load(work, "b1"), load(work, "a4"))
    same_run(load(work, "c4"), load(work, "a4"))  # the head's cross-entropy 3 rows at a time


def test_matches_the_hf_trainer(work):
    """Per-step losses equal the HF Trainer's at its defaults (micro 1 x accumulation 4); the
    micro_batch option equals the HF Trainer forced to per-micro-batch means; the two objectives
    really differ on this data (the test could fail)."""
    ours, hf = load(work, "a4"), load(work, "hf4")
    same_run(ours, hf, weights=False, norms=False)
    mean, hf_mean = load(work, "m4"), load(work, "hfm4")
    same_run(mean, hf_mean, weights=False, norms=False)
    assert max(abs(a - b) for a, b in zip(ours["losses"], mean["losses"])) > 1e-4
    assert ours["losses"][-1] < ours["losses"][0]


@pytest.mark.slow
def test_split_invariance_two_ranks(work):
    """2 ranks x accumulation 2 x micro 1 under ZeRO-0, 2 and 3 (and 3 with the cross-entropy in
    chunks; tp 2 with it too, within tp's rounding) == 1 rank x accumulation 4;
    the pipeline (pp 2) with micro 1 x accumulation 4 == micro 4 x accumulation 1; LOMO on
    2 ranks x micro 2 == 1 rank x micro 4 (its own averaging over the ranks)."""
    launch(work, 2, TWO_RANKS)
    ref = load(work, "a4")
    same_run(load(work, "z0"), ref, norms=False)  # ZeRO-0's engine keeps no global norm
    for name in ("z2", "z3", "z3c"):  # z3c: the cross-entropy in chunks of 3 rows under ZeRO-3
        same_run(load(work, name), ref)
    tp = load(work, "tpc")  # AutoTP's sharded head called chunk by chunk; tp reorders each matmul's sums
    assert tp["losses"] == pytest.approx(ref["losses"], rel=2e-5), list(zip(tp["losses"], ref["losses"]))
    same_run(load(work, "ppb"), load(work, "ppa"), norms=False)  # the pipeline engine keeps no norm
    # pp's last stage runs the head at labelled rows only (ppa, the default) and in chunks (ppc):
    # the losses and weights of the head everywhere (ppe)
    for name in ("ppa", "ppc"):
        same_run(load(work, name), load(work, "ppe"), norms=False)
    same_run(load(work, "l2"), load(work, "l4"))


# -- the pieces, without DeepSpeed -------------------------------------------------------------

def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4)).eval()


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for rows, width, masked in ((2, 9, 3), (1, 5, 0)):  # uneven: 2 x 6 and 1 x 4 targets
        ids = torch.randint(3, 40, (rows, width), generator=g)
        labels = ids.clone()
        labels[:, :masked] = -100  # a prompt that is no target
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def test_window_pieces_give_the_sum_of_token_losses_over_n():
    """model_loss with a token window is sum(token losses) / N, summed over the micro-batches;
    a loss_fn naming num_items_in_batch gets N (HF's convention); one that does not, and a model
    whose forward takes no num_items_in_batch, are weighed by their targets / N."""
    from engine.objectives.losses import PER_MICRO_BATCH, Window, count_targets, model_loss
    model, batches = _tiny_llama(), _batches()
    assert [count_targets(b["labels"]) for b in batches] == [2 * 6, 1 * 4]
    # unshifted (prompt tuning's count): a row's first label is a target when it is not -100
    assert [count_targets(b["labels"], shifted=False) for b in batches] == [2 * 6, 1 * 5]
    window = Window(num_items=16, scale=1.0)

    def token_sum(b):
        logits = model(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, 40)
        return torch.nn.functional.cross_entropy(logits, b["labels"][:, 1:].reshape(-1), reduction="sum")

    with torch.no_grad():
        want = sum(token_sum(b) for b in batches) / 16
        got = sum(model_loss(model, b, "cpu", None, window) for b in batches)
        torch.testing.assert_close(got, want)
        seen = []

        def counting(logits, labels, num_items_in_batch):
            seen.append(num_items_in_batch)
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1),
                                                     reduction="sum") / num_items_in_batch

        def mean_only(logits, labels):
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1))

        for fn in (counting, mean_only):
            torch.testing.assert_close(sum(model_loss(model, b, "cpu", fn, window) for b in batches), want)
        assert seen == [16, 16]

        class Plain(torch.nn.Module):  # a forward without **kwargs: no num_items_in_batch
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, input_ids, attention_mask, labels, use_cache):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

        plain = Plain()
        torch.testing.assert_close(sum(model_loss(plain, b, "cpu", None, window) for b in batches), want)
        # the per-micro-batch mean: each micro-batch's own mean, whatever its targets
        means = [model_loss(model, b, "cpu", None, PER_MICRO_BATCH) for b in batches]
        torch.testing.assert_close(means[1], token_sum(batches[1]) / 4)
