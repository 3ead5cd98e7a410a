"""Batched multi-turn episodes on the built-in tiny model: batched and one-at-a-time stepping play the same
episodes; environments that raise, hang or answer without text end their episode with a counted error; gymnasium
environments (FrozenLake built in, gym:ENV_ID, a plugin returning a gymnasium.Env); task.env checks."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from rollout_hpc.backends.episodes import EpisodeSettings
from rollout_hpc.backends.generate_hf import HFGenerator, SamplingParams
from rollout_hpc.backends.token_scores import lm_token_scores
from rollout_hpc.config import ModelSection, TaskSection, load_config
from rollout_hpc.envs import Prompt, SokobanEnv, load_task
from rollout_hpc.envs.registry import check_task
from rollout_hpc.envs.sokoban import SokobanLevels
from rollout_hpc.errors import PluginError, TaskError
from rollout_hpc.models import CharTokenizer, build_model
from rollout_hpc.runtime.generator_loop import make_generator
from rollout_hpc.runtime.objective import add_advantages, make_loss_fn
from rollout_hpc.runtime.records import collate
from rollout_hpc.trajectory import EPISODE_ERROR, EPISODE_OK, EPISODE_TIMEOUT, REWARD_ERROR, REWARD_TIMEOUT

torch.set_num_threads(1)
TOK = CharTokenizer()
CFG = ModelSection(hidden_size=32, num_layers=2, num_heads=2, max_seq_len=256)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, TOK.vocab_size, seed=0).eval()


def generator(model, task, parallel=64, max_new_tokens=1, **settings):
    gen = HFGenerator(model, TOK, task, SamplingParams(max_new_tokens=max_new_tokens, stop_ids=(TOK.eos_id,)), seed=3)
    gen.episodes = EpisodeSettings(parallel_envs=parallel, **settings)
    return gen


def records(batch):
    return [
        {k: np.asarray(v).tolist() for k, v in batch.record(i).items() if k not in ("t_start", "t_end")}
        for i in range(len(batch))
    ]


class Countdown:
    """Episode i lasts i + 1 turns; the observation repeats the reply."""

    def prompts(self, seed):
        return list(range(10))

    def make_env(self):
        return CountdownEnv()


class CountdownEnv:
    max_turns = 10

    def reset(self, item):
        self.left = int(item) + 1
        return f"{item}="

    def step(self, text):
        self.left -= 1
        return f"{text}!", 0.5, self.left == 0, {}


def test_batched_and_one_at_a_time_play_the_same_episodes(model):
    """A window of 3 environments (episodes join as others finish) and one at a time give the records of all at once:
    turn k of an episode samples from its own seed, whatever else is in the batch."""
    task = Countdown()
    runs = [generator(model, task, parallel=p).rollout(task.prompts(0), [0, 1, 2, 3], 3, 0, 0) for p in (64, 3, 1)]
    batched = runs[0]
    assert len(batched) == 12 and set(batched.fixed["episode_status"]) == {EPISODE_OK}
    assert batched.fixed["n_turns"].tolist() == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3  # they left the batch in turn
    assert batched.turn_rewards.tolist() == [0.5] * int(batched.fixed["n_turns"].sum())  # each turn's reward, logged
    for other in runs[1:]:
        for a, b in zip(records(batched), records(other)):
            np.testing.assert_allclose(a.pop("logprobs"), b.pop("logprobs"), atol=1e-5)
            assert a == b


def test_format_errors_are_counted_and_penalised(model):
    task = load_task(TaskSection(name="sokoban", params={"max_turns": 3, "invalid_penalty": 0.0, "step_cost": 0.0}))
    batch = generator(model, task, format_penalty=0.5).rollout(task.prompts(0), [0, 1], 4, 0, 0)
    f = batch.fixed
    assert f["format_errors"].sum() > 0  # a random model rarely replies with an action
    solved = f["success"].astype(float)
    np.testing.assert_allclose(f["reward"], solved - 0.5 * f["format_errors"], atol=1e-6)
    for i in range(len(batch)):  # the episode's reward is the sum of its turns' (format penalties included)
        assert batch.record(i)["turn_rewards"].sum() == pytest.approx(f["reward"][i], abs=1e-5)


def _raise(text):
    raise RuntimeError("the simulator crashed")


def _hang(text):
    time.sleep(30)


BROKEN = {  # step() from the second turn on, what it does, and what the record then says
    "raises": (_raise, EPISODE_ERROR, REWARD_ERROR, "crashed"),
    "hangs": (_hang, EPISODE_TIMEOUT, REWARD_TIMEOUT, "step_timeout"),
    "no text": (lambda text: ([1, 2], 0.0, False, {}), EPISODE_ERROR, REWARD_ERROR, "list observation, not text"),
    "nan reward": (lambda text: ("x", float("nan"), False, {}), EPISODE_ERROR, REWARD_ERROR, "finite"),
}


class FlakyEnv(SokobanEnv):
    """Sokoban whose episodes of odd prompt index misbehave from their second step on."""

    def __init__(self, how: str) -> None:
        super().__init__(max_turns=4)
        self.broken = BROKEN[how][0]

    def reset(self, prompt_item):
        self.odd = prompt_item.meta["index"] % 2 == 1
        return super().reset(prompt_item)

    def step(self, action_text):
        return self.broken(action_text) if self.odd and self.turns >= 1 else super().step(action_text)


class FlakyTask:
    def __init__(self, how: str) -> None:
        self.how, self.levels = how, SokobanLevels(0, SokobanEnv())

    def prompts(self, seed):
        return [Prompt(p.text, meta={**p.meta, "index": i}) for i, p in ((i, self.levels[i]) for i in range(4))]

    def make_env(self):
        return FlakyEnv(self.how)


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_environment_ends_its_episode_with_a_counted_error(model, how, capsys):
    task = FlakyTask(how)
    gen = generator(model, task, step_timeout=0.5)
    t0 = time.monotonic()
    batch = gen.rollout(task.prompts(0), [0, 1, 2, 3], 2, 0, 0)
    assert time.monotonic() - t0 < 10  # hung environments are waited for together, not one after another
    f = batch.fixed
    bad = f["episode_status"] != EPISODE_OK
    odd = f["prompt_id"] % 2 == 1
    assert not bad[~odd].any()  # only the misbehaving ones
    assert bad[odd & (f["n_turns"] >= 2)].all() and bad.any()  # (a solved first turn ends an episode in time)
    _, status, reward_status, words = BROKEN[how]
    assert set(f["episode_status"][bad]) == {status} and set(f["reward_status"][bad]) == {reward_status}
    assert (f["reward"][bad] == 0).all()
    for i in np.flatnonzero(bad):  # not trained on: no token of a failed episode is in the loss
        assert batch.record(i)["loss_mask"].sum() == 0
    err = capsys.readouterr().err
    assert words in err and re.search(r"environment of prompt [13] sample [01], turn [2-4]: ", err), err


def test_a_failing_reset_or_make_env_is_an_episode_error_too(model):
    class Task:
        def __init__(self):
            self.inner = load_task(TaskSection(name="sokoban"))

        def prompts(self, seed):
            return self.inner.prompts(seed)

        def make_env(self):
            raise OSError("no simulator licence")

    batch = generator(model, Task()).rollout(Task().prompts(0), [0], 2, 0, 0)
    assert list(batch.fixed["episode_status"]) == [EPISODE_ERROR] * 2
    assert batch.record(0)["prompt_len"] >= 1 and batch.record(0)["loss_mask"].sum() == 0


def test_frozenlake_builtin_scripted_and_with_the_model(model):
    task = load_task(TaskSection(name="frozenlake", params={"size": 4, "max_turns": 12}))
    item = task.prompts(0)[5]
    env = task.make_env()
    board = env.reset(item)
    assert board.startswith("Walk @") and board.partition("\n")[2].count("@") == 1 and "G" in board
    # the breadth-first way to the goal over the map, replayed as text actions, solves it
    desc = [row.decode() for row in map(bytes, env.env.unwrapped.desc)]
    path = _bfs(desc)
    assert path is not None
    for k, a in enumerate(path):
        obs, reward, done, info = env.step({"L": "left", "D": "d", "R": "R", "U": "up"}[a])
        assert done == (k == len(path) - 1)
    assert reward == 1.0 and info["success"]
    env = task.make_env()
    env.reset(item)
    obs, reward, done, info = env.step("jump")
    assert info["format_error"] and not done and "invalid action" in obs

    batch = generator(model, task, format_penalty=0.1).rollout(task.prompts(0), [0, 1], 4, 0, 0)
    assert set(batch.fixed["episode_status"]) == {EPISODE_OK}
    assert batch.fixed["n_turns"].max() <= 12


def _bfs(desc):
    from collections import deque

    n = len(desc)
    start = next((y, x) for y in range(n) for x in range(n) if desc[y][x] == "S")
    prev = {start: None}
    q = deque([start])
    moves = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
    while q:
        y, x = q.popleft()
        if desc[y][x] == "G":
            path, c = [], (y, x)
            while prev[c] is not None:
                c, a = prev[c]
                path.append(a)
            return path[::-1]
        for a, (dy, dx) in moves.items():
            ny, nx = y + dy, x + dx
            if 0 <= ny < n and 0 <= nx < n and (ny, nx) not in prev and desc[ny][nx] != "H":
                prev[(ny, nx)] = ((y, x), a)
                q.append((ny, nx))
    return None


def test_gym_env_id_and_plugin_factory(model, tmp_path):
    task = load_task(
        TaskSection(name="gym:FrozenLake-v1", params={"max_turns": 5, "env_kwargs": {"is_slippery": False}})
    )
    env = task.make_env()
    assert "@" in env.reset(task.prompts(0)[0])  # the built-in FrozenLake adapter
    # any Discrete-action environment: observations as text, actions by number
    cart = load_task(TaskSection(name="gym:CartPole-v1", params={"max_turns": 3}))
    env = cart.make_env()
    assert env.reset(cart.prompts(0)[0]).startswith("Reply with an action number 0-1")
    assert env.step("1")[2] is False and env.step("7")[3]["format_error"]
    # a plugin factory returning a gymnasium.Env, with its own text adapter attribute
    (tmp_path / "myenv.py").write_text(
        "import gymnasium as gym\n"
        "class Adapter:\n"
        "    instructions = 'go\\n'\n"
        "    def observation(self, obs, info, env): return f'at {obs}\\n'\n"
        "    def action(self, text, env): return {'left': 0, 'right': 2}.get(text.strip())\n"
        "def make_env(slippery=False):\n"
        "    env = gym.make('FrozenLake-v1', is_slippery=slippery)\n"
        "    env.text_adapter = Adapter()\n"
        "    return env\n"
    )
    plug = load_task(TaskSection(name=f"{tmp_path}/myenv.py:make_env", params={"slippery": False}))
    env = plug.make_env()
    assert env.reset(plug.prompts(0)[0]) == "go\nat 0\n" and env.step("right")[0] == "at 1\n"
    batch = generator(model, plug).rollout(plug.prompts(0), [0], 2, 0, 0)
    assert len(batch) == 2


def test_gym_and_task_env_refusals(tmp_path):
    with pytest.raises(TaskError, match="gym:NoSuchEnv-v0.*gymnasium.make failed"):
        load_task(TaskSection(name="gym:NoSuchEnv-v0"))
    with pytest.raises(TaskError, match="not Discrete.*task.params.adapter"):
        load_task(TaskSection(name="gym:Pendulum-v1"))
    with pytest.raises(PluginError, match="task.params.adapter"):
        load_task(TaskSection(name="gym:CartPole-v1", params={"adapter": f"{tmp_path}/none.py:A"}))
    (tmp_path / "a.yaml").write_text("task: {name: arithmetic, env: {parallel_envs: 8}}\n")
    with pytest.raises(TaskError, match="task.env.*single-turn"):
        check_task(load_config(tmp_path / "a.yaml", []))
    (tmp_path / "h.yaml").write_text("run: {hang_timeout: 60}\ntask: {name: sokoban, env: {step_timeout: 60}}\n")
    with pytest.raises(TaskError, match="task.env.step_timeout .* below run.hang_timeout"):
        check_task(load_config(tmp_path / "h.yaml", []))
    # A single-turn task never waits on an environment: a short hang_timeout is fine with the default step_timeout.
    check_task(load_config(None, ["run.hang_timeout=5"]))
    (tmp_path / "b.yaml").write_text("task: {name: sokoban, env: {parallel_envs: 0}}\n")
    with pytest.raises(Exception, match="task.env.parallel_envs"):
        load_config(tmp_path / "b.yaml", [])


def test_observation_tokens_carry_no_gradient(model, tmp_path):
    """The trainer's objective on real episodes (collate, the chunked scoring, GRPO advantages, the policy loss):
    the loss's gradient w.r.t. every observation token's log-probability is exactly 0, and perturbing what the
    record holds at observation tokens (sampling log-probs, advantages) leaves the parameters' gradient unchanged."""
    (tmp_path / "c.yaml").write_text("task: {name: sokoban}\nalgorithm: {group_size: 4}\n")
    cfg = load_config(tmp_path / "c.yaml", [])
    task = load_task(cfg.task)
    batch = generator(model, task).rollout(task.prompts(0), [0, 1], 4, 0, 0)
    tensors = collate(batch, TOK.pad_id)
    assert tensors["rewards"].std() > 0  # some advantage to follow
    add_advantages(cfg, tensors, None)
    p = (
        torch.arange(tensors["mask"].shape[1])[None, :]
        >= torch.from_numpy(batch.fixed["prompt_len"].astype("int64"))[:, None]
    )
    observation = (tensors["attention_mask"] == 1) & p & (tensors["mask"] == 0)
    assert observation.sum() > 100  # sokoban boards between the replies

    def gradients(b):
        model.zero_grad()
        # every position scored (positions None): the loss alone must leave the observations out
        logp, ent = lm_token_scores(model, b["input_ids"], b["attention_mask"], 1.0, 64)
        logp.retain_grad()
        loss, _ = make_loss_fn(cfg)(logp, ent, b)
        loss.backward()
        return logp.grad, [q.grad.clone() for q in model.parameters()]

    with torch.enable_grad():
        logp_grad, base = gradients(tensors)
        assert (logp_grad[observation] == 0).all() and (logp_grad[tensors["mask"] > 0] != 0).any()
        noise = torch.randn_like(tensors["old_logprobs"]) * 3
        perturbed = dict(tensors)
        perturbed["old_logprobs"] = torch.where(observation, noise, tensors["old_logprobs"])
        perturbed["advantages"] = torch.where(observation, noise, tensors["advantages"])
        _, other = gradients(perturbed)
    assert all(torch.equal(a, b) for a, b in zip(base, other))
    model.zero_grad()


def test_held_out_environment_seeds_for_eval(tmp_path):
    """eval: on a multi-turn task plays held-out episodes: sokoban levels and gymnasium seeds of their own stream."""
    sokoban = load_task(TaskSection(name="sokoban"))
    held_out, train = sokoban.eval_prompts(0), sokoban.prompts(0)
    assert len(held_out) == 64
    # their own seed stream (a 5x5 room has only 504 layouts: a held-out level may equal some training level)
    assert sum(p.text == train[i].text for i, p in enumerate(held_out)) < 4
    lake = load_task(TaskSection(name="frozenlake"))
    seeds = {lake.prompts(0)[i].meta["seed"] for i in range(1000)}
    assert len(lake.eval_prompts(0)) == 256 and not seeds & {p.meta["seed"] for p in lake.eval_prompts(0)}
    (tmp_path / "e.yaml").write_text("task: {name: frozenlake}\neval: {every_steps: 5}\n")
    check_task(load_config(tmp_path / "e.yaml", []))  # accepted


class Recomputing(HFGenerator):
    """The HF backend without its per-episode cache: every turn runs the whole context again."""

    def generate(self, prompts, seeds, params=None, cache_keys=None):
        return super().generate(prompts, seeds, params)


def test_episode_turns_reuse_their_keys_and_values(model):
    """An episode's next turn runs only its new tokens through the model (the reply's last token and the
    observation), and samples what running the whole context again samples."""
    task = load_task(TaskSection(name="sokoban", params={"max_turns": 5}))
    cached = generator(model, task, max_new_tokens=3).rollout(task.prompts(0), [0, 1, 2], 2, 0, 0)
    gen = generator(model, task, max_new_tokens=3)
    whole = Recomputing(model, TOK, task, gen.sampling, seed=3)
    whole.episodes = gen.episodes
    again = whole.rollout(task.prompts(0), [0, 1, 2], 2, 0, 0)
    assert cached.fixed["n_turns"].max() > 2
    assert cached.response_ids.tolist() == again.response_ids.tolist()
    np.testing.assert_allclose(cached.logprobs, again.logprobs, atol=1e-4)
    # what the backend keeps: the prompt and the reply but its last token, then only the new tokens run
    prompt = TOK.encode_prompt("#####\n#@$.#\n#####\n")
    first = gen.generate([prompt], [1], cache_keys=["e"])
    held = gen._prefixes["e"]
    assert held.ids == prompt + first.response_ids[0][:-1]
    assert held.kv(0)[0].shape[1] == len(held.ids)
    longer = prompt + first.response_ids[0] + TOK.encode("#####\n")
    assert held.covers(longer) == len(held.ids)
    np.testing.assert_allclose(
        gen.generate([longer], [2], cache_keys=["e"]).logprobs, whole.generate([longer], [2]).logprobs, atol=1e-4
    )
    # a next prompt that keeps only part of what is held (a reply cut at a stop string): that part is reused
    gen.generate([prompt, prompt[:5]], [1, 4], cache_keys=["e", "f"])
    cut = [prompt[:-3] + TOK.encode("L\n"), TOK.encode_prompt("new episode")]
    assert gen._prefixes["e"].covers(cut[0]) == len(prompt) - 3 and gen._prefixes["f"].covers(cut[1]) < 5
    np.testing.assert_allclose(
        sum(gen.generate(cut, [5, 6], cache_keys=["e", "f"]).logprobs, []),
        sum(whole.generate(cut, [5, 6]).logprobs, []),
        atol=1e-4,
    )
    gen.forget_prefixes()
    assert gen._prefixes == {}


def test_task_env_reaches_the_generator(model, tmp_path):
    """task.env as the generator loop builds its generator: replies of max_tokens_per_turn tokens (not
    algorithm.max_new_tokens), episodes capped at task.env.max_turns below the environment's own."""
    (tmp_path / "c.yaml").write_text(
        "task: {name: sokoban, params: {max_turns: 8}, env: {max_turns: 3, max_tokens_per_turn: 3, parallel_envs: 5}}\n"
        "algorithm: {max_new_tokens: 1}\n"
    )
    cfg = load_config(tmp_path / "c.yaml", [])
    task = load_task(cfg.task)
    gen = make_generator(cfg, model, TOK, task)
    assert gen.episodes == EpisodeSettings(parallel_envs=5, max_turns=3, format_penalty=0.0, step_timeout=30.0)
    batch = gen.rollout(task.prompts(0), [0, 1], 4, 0, 0)
    assert batch.fixed["n_turns"].max() == 3
    records = [batch.record(i) for i in range(len(batch))]
    replies = [int(r["loss_mask"][s : s + 4].sum()) for r in records for s in r["turn_starts"]]
    assert max(replies) == 3 and min(replies) >= 1  # up to 3 tokens a turn (a reply ends at EOS or the limit)


@pytest.mark.parametrize("hints", [False, True])
def test_sokoban_demonstrations_are_the_episodes_the_generator_would_build(hints):
    """An SFT warm-up on a multi-turn task (warmup.sft_steps) teaches whole episodes: the solver's moves as the
    trained tokens, the environment's observations between them in the context with no loss: token for token the
    record the episode loop builds when the policy replies with those moves."""
    from rollout_hpc.backends.episodes import rollout_episodes
    from rollout_hpc.backends.generator import Generation
    from rollout_hpc.runtime.sft import sft_batch, sft_stream

    cfg = load_config(
        None,
        [
            "task.name=sokoban",
            f"task.params={{size: 6, max_turns: 8, hints: {str(hints).lower()}}}",
            "warmup.sft_steps=1",
            "warmup.batch_size=12",
        ],
    )
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_new_tokens": 1})})
    task = load_task(cfg.task)
    stream = sft_stream(task, 0)
    batch = sft_batch(cfg, task, TOK, stream, 0)
    items = [stream[i] for i in range(12)]
    moves = [task.demonstration(item) for item in items]
    turn = [0] * len(items)

    def replay(prompts, live):  # the policy replies with the solver's next move
        ids = [[TOK.encode(moves[i][turn[i]])[0]] for i in live]
        for i in live:
            turn[i] += 1
        return Generation(ids, [[0.0]] * len(live), [False] * len(live))

    played = rollout_episodes(lambda i: task.make_env(), items, replay, TOK, 1, 512, EpisodeSettings(max_turns=8))
    assert len(batch) == 12
    for k, ep in enumerate(played):
        rec = batch.record(k)
        assert ep.success == (len(moves[k]) <= 8)  # a longer solution is cut at max_turns, as an episode is
        assert rec["prompt_ids"].tolist() == ep.prompt_ids
        assert rec["response_ids"].tolist() == ep.response_ids and rec["loss_mask"].tolist() == ep.loss_mask
        assert rec["turn_starts"].tolist() == ep.turn_starts
        trained = rec["response_ids"][rec["loss_mask"] == 1]
        assert TOK.decode(trained.tolist()) == "".join(moves[k][:8])
    assert sum(ep.success for ep in played) >= 6


def test_a_multi_turn_sft_warmup_needs_demonstrations():
    from rollout_hpc.errors import DatasetError
    from rollout_hpc.runtime.sft import sft_batch

    cfg = load_config(None, ["task.name=frozenlake", "warmup.sft_steps=1", "warmup.batch_size=2"])
    with pytest.raises(TaskError, match=r"warmup.sft_steps on multi-turn task 'frozenlake' .* no demonstration"):
        check_task(cfg)
    task = load_task(cfg.task)
    with pytest.raises(DatasetError, match=r"no demonstration\(item\) method .* or set warmup.sft_steps: 0"):
        sft_batch(cfg, task, TOK, task.prompts(0), 0)


KNOWN_LEVEL = "#####\n#@  #\n# $ #\n#  .#\n#####"  # player (1, 1), box (2, 2), target (3, 3)


def test_step_advantages_compare_the_turns_that_acted_on_the_same_board():
    """algorithm.step_advantage_weight (GiGPO): a group of scripted sokoban episodes played through the real episode
    loop; the turn table finds the turns that saw the same board (checked against the boards a fresh environment
    shows), their returns-to-go come from the environment's turn rewards, and the step-level advantage lands on
    those turns' reply tokens only: (R - mean) / std over the turns that saw a board, 0 for a board seen once."""
    from rollout_hpc.backends.episodes import rollout_episodes
    from rollout_hpc.backends.generator import Generation, episode_batch
    from rollout_hpc.envs.sokoban import Level
    from rollout_hpc.runtime.objective import step_advantages
    from rollout_hpc.runtime.records import turn_table

    level = Level.from_text(KNOWN_LEVEL)
    # 0 and 2 solve in 5 moves (pushing right then down, or down then right); 1 and 3 set out as they do and stray
    plays = ["DRURD", "DRUUL", "RDLDR", "RDLLL"]
    turn = [0] * len(plays)

    def scripted(prompts, live):
        ids = [[TOK.encode(plays[i][turn[i]])[0]] for i in live]
        for i in live:
            turn[i] += 1
        return Generation(ids, [[-1.0]] * len(live), [False] * len(live))

    make_env = lambda i: SokobanEnv(max_turns=5, instructions=False, hints=True)  # noqa: E731
    eps = rollout_episodes(make_env, [level] * 4, scripted, TOK, 1, 512, EpisodeSettings(max_turns=5))
    assert [e.success for e in eps] == [True, False, True, False]
    common = dict(prompt_index=[0] * 4, sample_idx=[0, 1, 2, 3], gen_rank=0, policy_version=0, t_start=0.0)
    batch = episode_batch(eps, common)
    turns = turn_table(batch, gamma=1.0)
    assert turns["row"].tolist() == [i for i in range(4) for _ in range(5)]

    boards = []  # the board each turn acted on, from a fresh environment
    for moves in plays:
        env = make_env(0)
        seen = [env.reset(level)]
        seen += [env.step(m)[0] for m in moves[:-1]]
        boards += seen
    state = turns["state"].tolist()
    assert all((state[a] == state[b]) == (boards[a] == boards[b]) for a in range(20) for b in range(20))
    assert len(set(state)) < 20  # shared boards exist: all first turns, 0 and 1's first three, ...
    returns = [sum(e.turn_rewards[k:]) for e in eps for k in range(5)]
    assert turns["ret"].tolist() == pytest.approx(returns)
    r = eps[1].turn_rewards
    discounted = turn_table(batch, gamma=0.5)["ret"].tolist()[5:10]
    assert discounted[3:] == pytest.approx([r[3] + 0.5 * r[4], r[4]])

    expected = []
    for k in range(20):
        same = [returns[j] for j in range(20) if boards[j] == boards[k]]
        expected.append(0.0 if len(same) == 1 else (returns[k] - np.mean(same)) / (np.std(same, ddof=1) + 1e-6))
    tensors = collate(batch, TOK.pad_id)
    adv = step_advantages(turns, 4, tensors["mask"])
    assert (adv[tensors["mask"] == 0] == 0).all()
    replies = [v for i in range(4) for v in adv[i][tensors["mask"][i] > 0].tolist()]
    assert replies == pytest.approx(expected, abs=1e-5)
    assert replies[0] > 0 > replies[5]  # the first move down: the episode that solved beats the one that strayed


def test_step_advantage_weight_needs_a_multi_turn_task_and_a_group_algorithm(tmp_path):
    (tmp_path / "c.yaml").write_text("task: {name: arithmetic}\nalgorithm: {step_advantage_weight: 1.0}\n")
    with pytest.raises(TaskError, match="step_advantage_weight compares the turns of multi-turn episodes"):
        check_task(load_config(tmp_path / "c.yaml", []))
    with pytest.raises(Exception, match="algorithm 'ppo' has no groups"):
        load_config(tmp_path / "c.yaml", ["task.name=sokoban", "algorithm.name=ppo"])
    cfg = load_config(tmp_path / "c.yaml", ["task.name=sokoban", "algorithm.name=rloo"])
    assert check_task(cfg) is not None
