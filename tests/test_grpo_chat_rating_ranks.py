"""Rating a chat answer on 2 ranks under ZeRO-3 (engine.objectives.grpo_chat): the chat answer and
the group's fresh samples are collective generations, every rank draws and scores the same group
(rank 0's scores used), the group trains on the first data-parallel rank; the rated step and a
resume from before the rating agree bit for bit. One launch, two Trainers in one process group
(tests/scripts/grpo_chat_ranks.py). The rest on one rank: tests/test_grpo_chat_rating.py."""

import json

import pytest

from dist_utils import SCRIPTS, parse_results, run_deepspeed

pytestmark = pytest.mark.slow  # one 2-rank launch of a tiny Llama


def test_a_chat_rating_trains_its_group_on_two_ranks_and_a_resume_repeats_it(tmp_path):
    from conftest import save_tiny_llama
    from engine.data import default_task

    save_tiny_llama(tmp_path / "model")
    rows = [{"prompt": r["input"], "answer": r["output"]} for r in default_task.make_examples(32, 5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_deepspeed(SCRIPTS / "grpo_chat_ranks.py", nproc=2, timeout=600,
                         args=["--model", str(tmp_path / "model"), "--data", str(tmp_path / "prompts.jsonl"),
                               "--out", str(tmp_path / "runs")])
    [result] = parse_results(proc)
    rated = result["replies"]["2"]
    assert rated["type"] == "done", rated
    assert rated["result"]["id"] == "t1" and rated["result"]["answer_step"] == 1
    assert rated["result"]["applies_from_step"] == 3 and rated["result"]["group_size"] == 4
    first, again = result["first"], result["again"]
    assert "rewards/human/mean" not in first["2"] and first["3"]["rewards/human/mean"] == 0.25
    assert sorted(again) == ["3"] and again["3"] == first["3"]  # loss and every reward metric, bit for bit
