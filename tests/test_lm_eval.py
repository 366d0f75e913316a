"""jaxmoe as an lm-eval model against lm-eval's own ``hf`` model on a tiny random Qwen3-MoE (the
configs of tests/test_hf_reference.py, weights x8) with a word-level tokenizer, on two local tasks
(tests/data/lm_eval/: multiple choice = loglikelihood, generation = generate_until): the same
per-request log-likelihoods (within 1e-4), greedy flags, generated text and scores."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_generate_hf import _build  # noqa: E402

import jaxmoe.train.lm_eval_model  # noqa: E402,F401 (registers --model jaxmoe)

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmeval") / "qwen3"
    model = _build("qwen3-norm", seed=1)
    model.config.eos_token_id = model.generation_config.eos_token_id = 1
    model.save_pretrained(d)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", pad_token="w0", unk_token="w0")
    fast.save_pretrained(d)
    return d


def _run(model, model_args, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    return simple_evaluate(model=model, model_args=model_args, tasks=["jaxmoe_local_mc", "jaxmoe_local_gen"],
                           task_manager=TaskManager(include_path=str(TASKS)), log_samples=True, batch_size=1)


@pytest.mark.heavy  # README "what stays out": lm-eval + accelerate are not CI dependencies; ~75 s here
def test_scores_agree_with_lm_evals_hf_model(hf_dir, monkeypatch):
    ours = _run("jaxmoe", f"ckpt=hf:{hf_dir}", monkeypatch)
    ref = _run("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", monkeypatch)
    for task in ("jaxmoe_local_mc", "jaxmoe_local_gen"):
        a, b = ours["samples"][task], ref["samples"][task]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"]):
                if task.endswith("mc"):
                    (llx, gx), (lly, gy) = rx[0], ry[0]
                    assert abs(llx - lly) <= 1e-4 and gx == gy, (llx, lly)
                else:
                    assert rx == ry
        metric = "acc,none" if task.endswith("mc") else "exact_match,none"
        assert ours["results"][task][metric] == ref["results"][task][metric]
    gens = [s["resps"][0][0] for s in ours["samples"]["jaxmoe_local_gen"]]
    assert any(gens)  # text was generated
