"""One self-contained HTML report of a run: summary, warnings, figures (embedded PNGs, the eval curve among
them), the eval table, sample trajectories."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import jinja2
import numpy as np

from rollout_hpc.analysis.figures import FIGURES, png_bytes
from rollout_hpc.analysis.run_info import config_text, flatten, resolved_config
from rollout_hpc.analysis.samples import (
    last_step,
    load_answers,
    load_decoder,
    load_samples,
    render_sample,
    select_rows,
)
from rollout_hpc.analysis.summary import analyze_run
from rollout_hpc.store.trajlog import TrajectoryReader, log_path

_TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rollout-hpc report: {{ title }}</title>
<style>
 body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
 table { border-collapse: collapse; } td, th { padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: left; }
 td.num { text-align: right; font-variant-numeric: tabular-nums; }
 .warn { background: #fff3cd; border-left: 4px solid #e0a800; padding: 6px 10px; margin: 4px 0; }
 img { max-width: 100%; } pre { background: #f6f8fa; padding: 8px; overflow-x: auto; }
</style></head><body>
<h1>Run {{ title }}</h1>
<p>{{ log_line }}</p>
{% for w in warnings %}<div class="warn">{{ w }}</div>{% endfor %}
<h2>Summary</h2>
<table>{% for key, value in rows %}<tr><th>{{ key }}</th><td class="num">{{ value }}</td></tr>{% endfor %}</table>
{% if eval_rows %}<h2>Validation during training</h2>
<table><tr>{% for name in eval_names %}<th>{{ name }}</th>{% endfor %}</tr>
{% for row in eval_rows %}<tr>{% for v in row %}<td class="num">{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% endif %}{% if domain_rows %}<h2>Sources (mixed dataset)</h2>
<table><tr><th>source</th><th>samples</th><th>reward, first step</th><th>reward, last step</th><th>mean reward</th>
<th>last eval accuracy</th></tr>
{% for row in domain_rows %}<tr>{% for v in row %}<td class="num">{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% endif %}{% if rm_rows %}<h2>Reward models</h2>
<table><tr><th>model</th><th>samples scored</th><th>mean score, first step</th><th>mean score, last step</th>
<th>unparsed judge replies</th></tr>
{% for row in rm_rows %}<tr>{% for v in row %}<td class="num">{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% endif %}<h2>Configuration</h2>
{% if config_text is none %}<p>no config.resolved.yaml beside this log</p>{% else %}
<table>{% for key, value in hyperparameters %}<tr><th>{{ key }}</th><td>{{ value }}</td></tr>{% endfor %}</table>
<details><summary>resolved config (config.resolved.yaml: every key, defaults filled in)</summary>
<pre>{{ config_text }}</pre></details>{% endif %}
<h2>Figures</h2>
{% for name, data in figures %}<figure><img alt="{{ name }}" src="data:image/png;base64,{{ data }}"></figure>{% endfor %}
<h2>Sample trajectories (step {{ sample_step }})</h2>
{% for heading, texts in samples %}<h3>{{ heading }}</h3>{% for t in texts %}<pre>{{ t }}</pre>{% endfor %}{% endfor %}
</body></html>
""")


def _fmt(value) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _flatten(summary: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in summary.items():
        if key in ("warnings", "log", "eval", "domains", "reward_models"):  # tables of their own below
            continue
        if isinstance(value, dict) and key != "histogram":
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", _fmt(value)))
    return rows


def _eval_table(evals: dict) -> tuple[list[str], list[list[str]]]:
    """Column names (those with any value; time left out) and formatted rows of the eval table."""
    names = [n for n, v in evals.items() if n != "time" and not np.isnan(v).all()]
    rows = [
        [_fmt(int(evals[n][i]) if n == "step" else float(evals[n][i])) for n in names]
        for i in range(len(evals.get("step", ())))
    ]
    return names, rows


def _domain_rows(domains: dict) -> list[list[str]]:
    """One row per source of a mixed dataset: samples, reward at the first and last step, mean, last eval accuracy."""
    rows = []
    for name, d in domains.items():
        samples, reward = np.asarray(d["samples"], np.float64), np.asarray(d["reward"], np.float64)
        accuracy = d.get("accuracy")
        rows.append(
            [
                name,
                _fmt(int(samples.sum())),
                _fmt(float(reward[0])) if len(reward) else "n/a",
                _fmt(float(reward[-1])) if len(reward) else "n/a",
                _fmt(float((reward * samples).sum() / samples.sum())) if samples.sum() else "n/a",
                _fmt(float(accuracy[-1])) if accuracy is not None and len(accuracy) else "n/a",
            ]
        )
    return rows


def _reward_model_rows(models: dict) -> list[list[str]]:
    """One row per reward model: samples scored, mean raw score at the first and last step, unparsed replies."""
    return [
        [
            name,
            _fmt(sum(d["scored"])),
            _fmt(d["mean"][0]) if d["mean"] else "n/a",
            _fmt(d["mean"][-1]) if d["mean"] else "n/a",
            _fmt(d["parse_failures_total"]),
        ]
        for name, d in models.items()
    ]


def _hyperparameters(config: dict | None) -> list[tuple[str, str]]:
    """The algorithm section's keys (the hyperparameters) and the model, each as (dotted key, value)."""
    if not config:
        return []
    shown = {"model": config.get("model") or {}, "algorithm": config.get("algorithm") or {}}
    return [(key, _fmt(value)) for key, value in flatten(shown).items() if value is not None]


def write_report(run_dir_or_log: str | Path, out: str | Path | None = None, samples_per_kind: int = 3) -> Path:
    path = log_path(run_dir_or_log)
    analysis = analyze_run(path)
    figures = [(name, base64.b64encode(png_bytes(draw(analysis))).decode()) for name, draw in FIGURES.items()]
    decode = load_decoder(path.parent)
    answer = load_answers(path.parent)
    with TrajectoryReader(path) as reader:
        step = last_step(reader)
        sections = []
        if step is not None:
            for mode in ("best", "worst"):
                rows = select_rows(reader, step=step, mode=mode, k=samples_per_kind)
                sections.append(
                    (f"{mode} by reward", [render_sample(s, decode, answer) for s in load_samples(reader, rows)])
                )
    out = Path(out) if out else path.parent / "report.html"
    out.write_text(
        _TEMPLATE.render(
            title=html.unescape(str(analysis.summary.get("run_name") or path.parent.name)),
            log_line=analysis.summary["log"],
            warnings=analysis.warnings,
            rows=_flatten(analysis.summary),
            figures=figures,
            samples=sections,
            sample_step=step,
            domain_rows=_domain_rows(analysis.domains),
            rm_rows=_reward_model_rows(analysis.summary.get("reward_models") or {}),
            config_text=config_text(path.parent),
            hyperparameters=_hyperparameters(resolved_config(path.parent)),
            **dict(zip(("eval_names", "eval_rows"), _eval_table(analysis.eval))),
        )
    )
    return out
