"""Benchmark tasks in evaluate (``components.evaluate.tasks``): EleutherAI's lm-evaluation-harness scores each
checkpoint of a small llama run on task files written here (multiple-choice and loglikelihood, data beside
them, no network); the scores are checked against the same likelihoods computed with ``transformers`` on the
exported directory, land in evaluation.json, the report and the KFP Metrics, and decide promotion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from kfp import dsl

from components.evaluate.tasks import TaskError, byte_tokenizer, check_task_settings, gate_on_task, parse_promote_on
from components.evaluate.evaluate import EvaluationError, evaluate_run
from components.evaluate.evaluate_op import evaluate_op
from pipelines.cli import main as cli
from tests.eval_task_files import LL_TASK, MC_DOCS, MC_TASK, write_task_files
from tests.test_evaluate_models import SMALL, llama_run, trained_state
from trainer.data import ensure_default_dataset
from trainer.layout import step_dir
from trainer.models import resolve_model
from trainer.models.hf import export_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
LIMIT = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return ensure_default_dataset(tmp_path_factory.mktemp("fsx"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> str:
    mc, ll = write_task_files(tmp_path_factory.mktemp("evals"))
    return f"{mc},{ll}"


@pytest.fixture(scope="module")
def states(data) -> dict[str, dict]:
    """Trained weights, and the same with the output layer negated: a model that prefers what text lacks."""
    late = trained_state(resolve_model("llama", "debug", SMALL), data, 30)
    return {"late": late, "anti": dict(late, **{"output.weight": -late["output.weight"]})}


def reference_mc(run: Path, step: int, tmp: Path) -> tuple[float, float]:
    """(acc, acc_norm) of the multiple-choice task by transformers on the checkpoint's export: the choice with
    the highest log-likelihood after the question (acc_norm: per byte of the choice)."""
    hf = export_checkpoint(step_dir(run / "checkpoints", step), resolve_model("llama", "debug", SMALL), tmp / "ref")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    acc = acc_norm = 0
    for doc in MC_DOCS[:LIMIT]:
        lls = []
        for choice in doc["choices"]:
            ids = torch.tensor([list((doc["question"] + choice).encode())])
            n = len(choice.encode())
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            lls.append(logp[-n:].gather(1, ids[0, -n:, None]).sum().item())
        acc += max(range(len(lls)), key=lls.__getitem__) == doc["answer"]
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["answer"]
    return acc / LIMIT, acc_norm / LIMIT


def test_the_byte_tokenizer_gives_the_byte_ids():
    text = "déf f(x):\n\treturn ~x\x7f"
    tok = byte_tokenizer()
    assert tok(text).input_ids == list(text.encode()) and tok.decode(list(text.encode())) == text


def test_settings_are_checked_before_anything_runs():
    assert str(parse_promote_on("task:arc_easy/acc_norm")) == "task:arc_easy/acc_norm"
    for bad, why in [("task:arc_easy", "expected val_loss or task"), ("loss", "expected val_loss or task")]:
        with pytest.raises(TaskError, match=why):
            parse_promote_on(bad)
    with pytest.raises(TaskError, match="needs eval_tasks"):
        check_task_settings("", 0, "task:arc_easy/acc")
    with pytest.raises(TaskError, match="eval_limit must be"):
        check_task_settings("arc_easy", -1, "val_loss")
    with pytest.raises(TaskError, match="not a harness task name"):
        check_task_settings("arc easy", 0, "val_loss")
    with pytest.raises(TaskError, match="s3://BUCKET"):
        check_task_settings("https://example.com/t.yaml", 0, "val_loss")


def test_the_task_gate_compares_the_best_score_with_production_s_recorded_one():
    promote = parse_promote_on("task:mc/acc")
    best = {"step": 20, "tasks": {"mc": {"acc": 0.5}}}

    def decide(production, tolerance=0.0, passed=True):
        gate = {"passed": passed, "reason": "loss ok"}
        gate_on_task(gate, best, promote, production, tolerance)
        return gate

    prod = {"version": "v1", "tasks": {"mc": {"acc": 0.6}}}
    refused = decide(prod)
    assert not refused["passed"] and "below production v1 (0.6000)" in refused["reason"]
    assert decide(prod, tolerance=0.1)["passed"] and decide(dict(prod, tasks={"mc": {"acc": 0.5}}))["passed"]
    unrecorded = decide({"version": "v0", "tasks": {}})
    assert unrecorded["passed"] and "has no recorded task:mc/acc, so it is not compared" in unrecorded["reason"]
    assert decide(None)["passed"] and not decide(prod, passed=False)["passed"]     # the loss gate comes first


def test_tasks_score_each_checkpoint_report_it_and_decide_promotion(data, tasks, states, tmp_path):
    run = llama_run(tmp_path, "tasks-run", data, {10: states["anti"], 20: states["late"]})
    registry = tmp_path / "registry"
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "m"))
    report = dsl.HTML(name="report", uri=str(tmp_path / "report.html"))
    report.path = str(tmp_path / "report.html")
    out = evaluate_op.python_func(run_dir=str(run), out_dir=str(tmp_path / "out"), registry=str(registry),
                                  model_name="llama", eval_tasks=tasks, eval_limit=LIMIT,
                                  promote_on=f"task:{MC_TASK}/acc_norm", threshold=100.0, metrics=metrics,
                                  report=report)
    saved = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert [c["step"] for c in saved["checkpoints"]] == [10, 20]
    for c in saved["checkpoints"]:
        assert set(c["tasks"]) == {MC_TASK, LL_TASK}
        assert set(c["tasks"][LL_TASK]) == {"perplexity", "acc"} and c["tasks"][LL_TASK]["perplexity"] > 1
        # The harness's scores are the checkpoint's: transformers on its export gives the same choices.
        acc, acc_norm = reference_mc(run, c["step"], tmp_path / f"ref-{c['step']}")
        assert (c["tasks"][MC_TASK]["acc"], c["tasks"][MC_TASK]["acc_norm"]) == pytest.approx((acc, acc_norm))
    anti, late = (c["tasks"][MC_TASK]["acc_norm"] for c in saved["checkpoints"])
    assert late > anti        # the trained weights prefer Python to byte noise, the negated ones the noise

    # The best checkpoint is the task's best; promoted with no production yet, and its scores recorded.
    assert out.promoted and out.best_step == 20 and saved["gate"]["promote_on"] == f"task:{MC_TASK}/acc_norm"
    production = json.loads((registry / "llama" / "production.json").read_text())
    assert production["tasks"][MC_TASK]["acc_norm"] == late
    card = (registry / "llama" / "tasks-run-step000000020" / "README.md").read_text()
    assert f"| {MC_TASK} | acc_norm | {late:.4f} |" in card and "from_pretrained" in card

    html = Path(report.path).read_text()
    assert "Benchmark tasks" in html and f"{MC_TASK} against step" in html and f"{LL_TASK} against step" in html
    assert html.count("<tr class=best><td>20</td>") == 2        # checkpoints table, tasks table

    # A run whose task score is below production's recorded one is refused on it, whatever its loss.
    worse = llama_run(tmp_path, "worse-run", data, {30: states["anti"]})
    refused = evaluate_run(worse, out_dir=tmp_path / "worse", registry=str(registry), model_name="llama",
                           eval_tasks=tasks, eval_limit=LIMIT, promote_on=f"task:{MC_TASK}/acc_norm", threshold=100.0)
    assert not refused.promoted and refused.registered is None
    assert f"is below production tasks-run-step000000020 ({late:.4f})" in refused.gate["reason"]
    assert json.loads((registry / "llama" / "production.json").read_text()) == production

    # The component logged every task metric of every checkpoint and of the best to KFP Metrics.
    assert metrics.metadata[f"step_10_{MC_TASK}_acc_norm"] == anti
    assert metrics.metadata[f"best_{MC_TASK}_acc_norm"] == late
    assert metrics.metadata[f"step_20_{LL_TASK}_perplexity"] == saved["checkpoints"][1]["tasks"][LL_TASK]["perplexity"]


def test_a_task_whose_data_cannot_be_read_fails_the_step_by_name_before_scoring(data, states, tmp_path):
    mc, _ = write_task_files(tmp_path / "evals")
    (tmp_path / "evals" / "mc.jsonl").unlink()
    run = llama_run(tmp_path, "run", data, {10: states["anti"]})
    with pytest.raises(EvaluationError, match=rf"eval task '{mc}' cannot be loaded .*mc\.jsonl"):
        evaluate_run(run, out_dir=tmp_path / "out", registry=str(tmp_path / "registry"), eval_tasks=str(mc),
                     threshold=100.0)
    assert not (tmp_path / "registry").exists()
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--out", str(tmp_path / "cli"), "--tasks", str(mc),
                                   "--limit", "2", "--threshold", "100"])
    assert res.exit_code == 1 and f"eval task '{mc}' cannot be loaded" in res.output, res.output
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--promote-on", "task:py_mc/acc"])
    assert res.exit_code == 2 and "needs eval_tasks" in res.output, res.output
    with pytest.raises(EvaluationError, match=f"the task 'other' is not among the evaluated tasks .*{LL_TASK}"):
        evaluate_run(run, out_dir=tmp_path / "out", eval_tasks=str(tmp_path / "evals" / "ll.yaml"),
                     promote_on="task:other/acc")


def test_task_files_on_s3_are_loaded_with_the_data_beside_them(s3, tmp_path):
    from components.evaluate.tasks import load_tasks

    write_task_files(tmp_path / "evals")
    client = s3.client()
    client.create_bucket(Bucket="evals")
    for f in (tmp_path / "evals").iterdir():
        client.upload_file(str(f), "evals", f"suite/{f.name}")
    suite = load_tasks(["s3://evals/suite/mc.yaml", "s3://evals/suite/ll.yaml"], 2, tmp_path / "scratch", s3.url)
    assert suite.names == [MC_TASK, LL_TASK]
    with pytest.raises(TaskError, match="'s3://evals/suite/none.yaml': no such object"):
        load_tasks(["s3://evals/suite/none.yaml"], 2, tmp_path / "scratch2", s3.url)
