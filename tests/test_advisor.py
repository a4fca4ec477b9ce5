"""``goodput advise``: the arithmetic against cases worked out by hand, and the command around it.

Every expected number below is a literal computed by hand; the comment above it shows the derivation.
Notation: n instances, rate per instance-hour, job MTBF M = 3600 / (n * rate) s, checkpoint blocking C s,
recovery R s, Young-Daly interval tau = sqrt(2 C M), goodput g = (1 - (R + tau/2)/M) / (1 + C/tau),
work W h, expected time T = W / g.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipelines.advisor import advise
from pipelines.cli import main


def test_spot_wins_when_the_discount_dwarfs_the_retries():
    a = advise(work_hours=19, gpus=16, gpus_per_instance=8, ckpt_block_s=45, recovery_s=900,
               interruption_rate=0.05, on_demand_price=100, spot_price=40)
    # n = 16 / 8 = 2 instances; job rate = 2 * 0.05 = 0.1 / h; M = 3600 / 0.1 = 36000 s
    assert a.instances == 2
    assert a.spot.failures_per_hour == pytest.approx(0.1) and a.spot.mtbf_s == pytest.approx(36000)
    # tau = sqrt(2 * 45 * 36000) = sqrt(3,240,000) = 1800 s
    assert a.spot.checkpoint_interval_s == pytest.approx(1800)
    # g = (1 - (900 + 900)/36000) / (1 + 45/1800) = 0.95 / 1.025; T = 19 * 1.025 / 0.95 = 20.5 h
    assert a.spot.goodput == pytest.approx(0.95 / 1.025)
    assert a.spot.expected_hours == pytest.approx(20.5)
    # 20.5 h * 0.1 / h = 2.05 interruptions; 20.5 h * 2 = 41 instance-hours; 41 * 40 = 1640
    assert a.spot.expected_interruptions == pytest.approx(2.05)
    assert a.spot.instance_hours == pytest.approx(41) and a.spot.expected_cost == pytest.approx(1640)
    # On-demand, no failures: exactly 19 h, 38 instance-hours, 38 * 100 = 3800, no checkpoint interval.
    assert a.on_demand.expected_hours == 19 and a.on_demand.expected_cost == pytest.approx(3800)
    assert a.on_demand.checkpoint_interval_s == math.inf and a.on_demand.expected_interruptions == 0
    # Discount 19 * 2 * (100 - 40) = 2280; retries (20.5 - 19) * 2 * 40 - 0 = 120 < 2280: spot.
    assert a.spot_discount == pytest.approx(2280) and a.interruption_cost == pytest.approx(120)
    assert a.recommendation == "spot"


def test_on_demand_wins_when_retries_cost_more_than_a_thin_discount():
    a = advise(work_hours=18, gpus=16, gpus_per_instance=8, ckpt_block_s=45, recovery_s=2700,
               interruption_rate=0.05, on_demand_price=100, spot_price=90)
    # Same M = 36000 s and tau = 1800 s as above.
    # g = (1 - (2700 + 900)/36000) / (1 + 45/1800) = 0.9 / 1.025; T = 18 * 1.025 / 0.9 = 20.5 h
    assert a.spot.expected_hours == pytest.approx(20.5)
    # spot: 41 instance-hours * 90 = 3690; on-demand: 18 h * 2 * 100 = 3600
    assert a.spot.expected_cost == pytest.approx(3690) and a.on_demand.expected_cost == pytest.approx(3600)
    # Discount 18 * 2 * (100 - 90) = 360; retries (20.5 - 18) * 2 * 90 = 450 > 360: on-demand.
    assert a.spot_discount == pytest.approx(360) and a.interruption_cost == pytest.approx(450)
    assert a.recommendation == "on-demand"
    assert "450.00" in a.reason and "360.00" in a.reason


def test_gpus_round_up_to_whole_instances():
    # 12 GPUs on 8-GPU instances = 2 instances, paid in full: the same numbers as 16 GPUs above.
    a = advise(work_hours=19, gpus=12, gpus_per_instance=8, ckpt_block_s=45, recovery_s=900,
               interruption_rate=0.05, on_demand_price=100, spot_price=40)
    assert a.instances == 2 and a.spot.expected_cost == pytest.approx(1640)


def test_spot_that_cannot_finish_is_never_recommended():
    a = advise(work_hours=10, gpus=8, gpus_per_instance=8, ckpt_block_s=45, recovery_s=1800,
               interruption_rate=2.0, on_demand_price=100, spot_price=1)
    # n = 1; rate 2 / h -> M = 1800 s; tau = sqrt(2 * 45 * 1800) = sqrt(162,000) = 402.49 s
    assert a.spot.mtbf_s == pytest.approx(1800) and a.spot.checkpoint_interval_s == pytest.approx(402.4922, abs=1e-3)
    # R + tau/2 = 1800 + 201.2 > M = 1800: g <= 0, the job is not expected to finish on spot at any price.
    assert a.spot.goodput == 0 and a.spot.expected_hours == math.inf and a.spot.expected_cost == math.inf
    assert a.recommendation == "on-demand" and "not expected to finish" in a.reason


def test_failures_that_hit_both_capacity_types_leave_the_choice_to_price():
    a = advise(work_hours=58, gpus=16, gpus_per_instance=8, ckpt_block_s=50, recovery_s=1500,
               interruption_rate=0.0, failure_rate=0.02, on_demand_price=100, spot_price=40)
    # n = 2; rate 2 * 0.02 = 0.04 / h on both -> M = 90000 s; tau = sqrt(2 * 50 * 90000) = sqrt(9e6) = 3000 s
    for opt in (a.spot, a.on_demand):
        assert opt.mtbf_s == pytest.approx(90000) and opt.checkpoint_interval_s == pytest.approx(3000)
        # g = (1 - (1500 + 1500)/90000) / (1 + 50/3000) = (29/30) / (61/60) = 58/61; T = 58 * 61/58 = 61 h
        assert opt.goodput == pytest.approx(58 / 61) and opt.expected_hours == pytest.approx(61)
    # spot 61 * 2 * 40 = 4880, on-demand 61 * 2 * 100 = 12200; retries 3*2*40 - 3*2*100 = -360 < 6960.
    assert a.spot.expected_cost == pytest.approx(4880) and a.on_demand.expected_cost == pytest.approx(12200)
    assert a.interruption_cost == pytest.approx(-360) and a.spot_discount == pytest.approx(6960)
    assert a.recommendation == "spot"


def test_bad_inputs_are_all_reported():
    with pytest.raises(ValueError) as e:
        advise(work_hours=0, gpus=0, ckpt_block_s=-1, recovery_s=1, interruption_rate=0.1, on_demand_price=10,
               spot_price=20)
    msg = str(e.value)
    assert "work_hours" in msg and "gpus" in msg and "ckpt_block_s" in msg and "above the on-demand" in msg


def test_cli_prints_json_from_gpu_hours_and_a_run_summary(tmp_path):
    summary = tmp_path / "summary.json"
    # A run measured 45 s blocking and recoveries of 800, 900 and 1000 s (median 900).
    summary.write_text(json.dumps({"ckpt_block_s_p50": 45.0, "faults": [
        {"recovered_s": 800.0}, {"recovered_s": 1000.0}, {"recovered_s": 900.0}, {"recovered_s": None}]}))
    # 304 GPU-hours on 16 GPUs = 19 h: the first case above.
    res = CliRunner().invoke(main, ["advise", "--gpu-hours", "304", "--gpus", "16", "--summary", str(summary),
                                    "--interruption-rate", "0.05", "--on-demand-price", "100", "--spot-price", "40",
                                    "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["recommendation"] == "spot" and out["spot"]["expected_hours"] == pytest.approx(20.5)
    assert out["on_demand"]["checkpoint_interval_s"] is None       # inf is written as null
    # The table form, and a usage error for contradictory inputs.
    res = CliRunner().invoke(main, ["advise", "--hours", "18", "--gpus", "16", "--ckpt-block-s", "45",
                                    "--recovery-s", "2700", "--interruption-rate", "0.05",
                                    "--on-demand-price", "100", "--spot-price", "90"])
    assert res.exit_code == 0 and "use on-demand" in res.output and "20.50" in res.output
    res = CliRunner().invoke(main, ["advise", "--hours", "1", "--gpu-hours", "8", "--gpus", "8",
                                    "--ckpt-block-s", "1", "--recovery-s", "1", "--interruption-rate", "0.1",
                                    "--on-demand-price", "2", "--spot-price", "1"])
    assert res.exit_code == 2 and "exactly one of --hours and --gpu-hours" in res.output


def test_the_advisor_imports_no_torch():
    code = "import sys, pipelines.advisor, pipelines.cli.advise; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
