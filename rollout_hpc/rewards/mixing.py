"""How rule and model rewards become one reward per sample (numpy only; docs/rewards.md "Reward models").

A sample's record carries its reward parts: part 0 is the task's rule reward, part 1 + m the raw score of
rewards.models[m] (NaN: a judge reply that did not parse; 0 where the model does not score the sample's source).

    reward = rule_weight x rule + sum over the models that score the sample of weight_m x norm_m(score_m)

norm_m is (score - running mean) / running std over every score the model gave so far (normalize: true), or the
score as it is. The generators combine raw scores (no normalization: the running statistics are the trainers'),
which is what dynamic sampling sees; the trainers recompute each step's rewards from the parts in uid order,
updating the statistics with the step's scores first, and keep the statistics in the checkpoint, so a resumed run
normalizes exactly as an uninterrupted one would. A parse failure counts in the step's metrics, is left out of
the statistics and scores parse_failure_score (raw; normalized like any score).
"""

from __future__ import annotations

import numpy as np


def metric_key(name: str, field: str) -> str:
    """The per-step metric of reward model `name`: rm/<name>/<field> (mean, std, parse_failures, scored)."""
    return f"rm/{name}/{field}"


def models_in_metrics(keys) -> list[str]:
    """The reward models named by metric keys (those of step_metrics), in order."""
    return [k[3:-5] for k in keys if k.startswith("rm/") and k.endswith("/mean")]


class RunningNorm:
    """Per-model running count, mean and sum of squared deviations (Chan et al.'s parallel merge)."""

    EPS = 1e-6

    def __init__(self, names: list[str]):
        self.names = list(names)
        m = len(names)
        self.count, self.mean, self.m2 = np.zeros(m), np.zeros(m), np.zeros(m)

    def update(self, scores: np.ndarray, valid: np.ndarray) -> None:
        """Merge a step's scores [B, M] where `valid` [B, M] (scored, parsed)."""
        for m in range(len(self.names)):
            x = scores[valid[:, m], m].astype(np.float64)
            if not len(x):
                continue
            n, mean = float(len(x)), float(x.mean())
            m2 = float(((x - mean) ** 2).sum())
            total = self.count[m] + n
            delta = mean - self.mean[m]
            self.m2[m] += m2 + delta * delta * self.count[m] * n / total
            self.mean[m] += delta * n / total
            self.count[m] = total

    def std(self) -> np.ndarray:
        var = np.where(self.count > 1, self.m2 / np.maximum(self.count - 1, 1), 1.0)
        return np.maximum(np.sqrt(var), self.EPS)

    def transform(self, scores: np.ndarray) -> np.ndarray:
        return (scores - self.mean[None, :]) / self.std()[None, :]

    def state_dict(self) -> dict:
        return {
            "names": list(self.names),
            "count": self.count.copy(),
            "mean": self.mean.copy(),
            "m2": self.m2.copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Statistics by model name: a model new to the config starts fresh, one removed is dropped."""
        saved = [n.decode() if isinstance(n, bytes) else str(n) for n in state["names"]]
        for m, name in enumerate(self.names):
            if name in saved:
                k = saved.index(name)
                for key, values in (("count", self.count), ("mean", self.mean), ("m2", self.m2)):
                    values[m] = float(np.asarray(state[key])[k])


class RewardMix:
    """The combination of one config's rewards (cfg.rewards; `domains`: a mixed dataset's source names in order)."""

    def __init__(self, rewards_cfg, domains: list[str]):
        specs = list(rewards_cfg.models)
        self.rule_weight = float(rewards_cfg.rule_weight)
        self.names = [s.name for s in specs]
        self.weights = np.array([s.weight for s in specs], np.float64)
        self.failure_scores = np.array([s.parse_failure_score for s in specs], np.float64)
        self.normalized = np.array([s.normalize for s in specs], bool)
        # scores[d, m]: model m scores records of source d (a dataset without named sources: one row)
        n_domains = max(len(domains), 1)
        self.scores = np.ones((n_domains, len(specs)), bool)
        for m, s in enumerate(specs):
            if s.domains is not None:
                self.scores[:, m] = [d in s.domains for d in domains]

    @property
    def n_parts(self) -> int:
        return 1 + len(self.names)

    def applies(self, domain: np.ndarray) -> np.ndarray:
        """bool [B, M]: which models score each record (by its `domain` index)."""
        d = np.minimum(np.asarray(domain, np.int64), len(self.scores) - 1)
        return self.scores[d]

    def _filled(self, scores: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(scores), self.failure_scores[None, :], scores)

    def _total(self, rule: np.ndarray, scores: np.ndarray, applies: np.ndarray) -> np.ndarray:
        model = (np.where(applies, scores, 0.0) * self.weights[None, :]).sum(axis=1)
        return (self.rule_weight * np.asarray(rule, np.float64) + model).astype(np.float32)

    def raw_reward(self, rule: np.ndarray, scores: np.ndarray, domain: np.ndarray) -> np.ndarray:
        """The generators' reward: raw scores (parse failures filled), no normalization."""
        return self._total(rule, self._filled(scores), self.applies(domain))

    def reward(self, parts: np.ndarray, domain: np.ndarray, norm: RunningNorm) -> np.ndarray:
        """The trainers' reward from parts [B, 1 + M] (a step's records in uid order): `norm` is updated first."""
        rule, scores = parts[:, 0], parts[:, 1:]
        applies = self.applies(domain)
        norm.update(scores, applies & ~np.isnan(scores))
        filled = self._filled(scores)
        scaled = np.where(self.normalized[None, :], norm.transform(filled), filled)
        return self._total(rule, scaled, applies)

    def step_metrics(self, parts: np.ndarray, domain: np.ndarray) -> dict[str, float]:
        """Per model: `rm/<name>/mean`, `/std` (raw scores that parsed), `/parse_failures`, `/scored`."""
        out: dict[str, float] = {}
        applies = self.applies(domain)
        for m, name in enumerate(self.names):
            x = parts[applies[:, m], 1 + m].astype(np.float64)
            ok = x[~np.isnan(x)]
            out[metric_key(name, "mean")] = float(ok.mean()) if len(ok) else float("nan")
            out[metric_key(name, "std")] = float(ok.std()) if len(ok) else float("nan")
            out[metric_key(name, "parse_failures")] = float(len(x) - len(ok))
            out[metric_key(name, "scored")] = float(len(x))
        return out
