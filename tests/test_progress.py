"""What a run shows per step: plain lines where stderr is not a terminal (a batch job's log), a bar
where it is, nothing with ``run.progress=false``."""

import io

from qarl_jax.run.progress import StepReport

METRICS = {
    "reward_mean": 0.53125,
    "accuracy": 0.5,
    "train/mismatch_mean_abs_diff": 0.0,
    "time/rollout_tokens_per_s": 1234.4,
    "time/step_s": 0.8412,
}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_plain_line_per_logged_step():
    log = io.StringIO()
    report = StepReport(start=2, total=7, log_every=2, show=True, stream=log)
    for done in range(3, 8):
        report.step(done, METRICS)
    report.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines == [  # steps 4 and 6 (every 2nd) and the last
        f"qarl: step {n}/7  reward 0.531  acc 0.500  mismatch 0.000  1234 tok/s  0.84 s/step"
        for n in (4, 6, 7)
    ]


def test_a_terminal_gets_a_bar_and_progress_false_nothing():
    terminal = Terminal()
    report = StepReport(start=0, total=3, log_every=1, show=True, stream=terminal)
    report.step(1, METRICS)
    report.close()
    assert "\r" in terminal.getvalue() and "reward=0.531" in terminal.getvalue()
    quiet = io.StringIO()
    report = StepReport(start=0, total=3, log_every=1, show=False, stream=quiet)
    report.step(1, METRICS)
    report.close()
    assert quiet.getvalue() == ""


def test_samples_scored_0_without_a_verdict_are_always_warned_of():
    log = io.StringIO()
    report = StepReport(start=0, total=4, log_every=4, show=False, stream=log)
    report.step(1, METRICS | {"grader/timeouts": 0, "grader/crashes": 0})
    report.step(2, METRICS | {"grader/timeouts": 3, "grader/crashes": 1})
    report.close()
    assert log.getvalue().splitlines() == [
        "qarl: step 2: samples scored 0 without a verdict: 3 ran out of time twice (raise"
        " rewards.time_limit_s or lower the load); 1 crashed their grading worker"
    ]
