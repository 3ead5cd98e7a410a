"""Built-in tasks: arithmetic prompts and exact-match rewards, sokoban levels, moves and rewards."""

import pytest

from rollout_hpc.config import ConfigError, TaskSection
from rollout_hpc.envs import (
    ArithmeticTask,
    Level,
    Prompt,
    SokobanEnv,
    TaskError,
    dataset_item,
    generate_level,
    is_multi_turn,
    load_task,
    parse_action,
    prompt_text,
)
from rollout_hpc.envs.sokoban import offset

KNOWN = """
#####
#@  #
# $ #
#  .#
#####
"""


def test_arithmetic_prompts_are_deterministic_and_correct():
    task = load_task(TaskSection(name="arithmetic", params={"max_operand": 5, "ops": "+-"}))
    a, b = task.prompts(7), task.prompts(7)
    items = [a[i] for i in range(200)]
    assert items == [b[i] for i in range(200)]
    assert [a[i] for i in (150, 3)] == [items[150], items[3]]  # random access
    assert items != [task.prompts(8)[i] for i in range(200)]
    for p in items:
        x, y, op = p.meta["a"], p.meta["b"], p.meta["op"]
        assert p.text == f"{x}{op}{y}=" and 0 <= x <= 5 and 0 <= y <= 5
        assert int(p.answer) == (x + y if op == "+" else x - y) >= 0
    assert {p.meta["op"] for p in items} == {"+", "-"}


def test_arithmetic_reward_is_exact_match():
    task = ArithmeticTask()
    p = Prompt("3+4=", answer="7")
    assert task.reward(p, "7") == 1.0
    assert task.reward(p, " 7\n") == 1.0  # surrounding whitespace is not part of the answer
    assert task.reward(p, "77") == 0.0
    assert task.reward(p, "8") == 0.0
    assert task.reward(p, "") == 0.0
    assert task.reward(Prompt("9-3=", answer="6"), "6") == 1.0


def test_task_errors_name_the_field():
    # config errors: the entry point prints them as one line, without a traceback
    with pytest.raises(ConfigError, match="task.params.ops"):
        load_task(TaskSection(name="arithmetic", params={"ops": "/"}))
    with pytest.raises(ConfigError, match="task.params for built-in task 'arithmetic'"):
        load_task(TaskSection(name="arithmetic", params={"max_operandz": 3}))
    with pytest.raises(ConfigError, match="task.name 'chess' is not a built-in"):
        load_task(TaskSection(name="chess"))


def test_prompt_items_and_finite_datasets():
    assert prompt_text("1+1=") == "1+1=" and prompt_text({"prompt": "x"}) == "x" and prompt_text(Prompt("y")) == "y"
    with pytest.raises(TypeError, match="no text"):
        prompt_text(42)
    assert [dataset_item(["a", "b"], i) for i in range(5)] == ["a", "b", "a", "b", "a"]


def test_sokoban_scripted_solve_of_a_known_level():
    level = Level.from_text(KNOWN)
    assert (level.player, level.box, level.target) == ((1, 1), (2, 2), (3, 3))
    env = SokobanEnv(max_turns=10, step_cost=0.05, instructions=False)
    assert env.reset(level) == KNOWN.lstrip("\n")
    plan = ["D", "right", "u", "R", "Down please"]  # letters, words, any case, first word counts
    assert level.solve() == ["D", "R", "U", "R", "D"]  # BFS finds the same 5-move solution
    rewards = []
    for i, action in enumerate(plan):
        obs, r, done, info = env.step(action)
        rewards.append(r)
        assert done == (i == len(plan) - 1)
    assert rewards == pytest.approx([-0.05] * 4 + [0.95])  # step cost each move, +1 when the box lands
    assert info["solved"] and not info["truncated"]
    assert obs == "#####\n#   #\n#  @#\n#  *#\n#####\n"  # box on target, player above it
    with pytest.raises(RuntimeError, match="reset"):
        env.step("U")


def test_sokoban_shaping_pays_for_each_cell_the_box_nears_the_target():
    env = SokobanEnv(max_turns=10, step_cost=0.05, shaping=0.2, instructions=False)
    env.reset(Level.from_text(KNOWN))  # box (2, 2), target (3, 3): 2 cells apart
    # walk, push it right (1 cell nearer), walk down, walk right (onto the target), push it up (1 cell farther)
    assert [env.step(a)[1] for a in "DRDRU"] == pytest.approx([-0.05, -0.05 + 0.2, -0.05, -0.05, -0.05 - 0.2])
    env.reset(Level.from_text(KNOWN))  # the solution: shaping adds 0.2 x 2 (potential-based: start - end distance)
    assert sum(env.step(a)[1] for a in ["D", "R", "U", "R", "D"]) == pytest.approx(0.95 - 4 * 0.05 + 0.4)
    with pytest.raises(ValueError, match="task.params.shaping must be >= 0"):
        SokobanEnv(shaping=-1)


def test_sokoban_hints_give_the_box_from_the_player_and_the_target_from_the_box():
    env = SokobanEnv(max_turns=10, instructions=False, hints=True)
    board = KNOWN.lstrip("\n")  # player (1, 1), box (2, 2), target (3, 3)
    assert env.reset(Level.from_text(KNOWN)) == board + "box D1R1 goal D1R1\n"
    assert env.step("R")[0].endswith("\nbox D1 goal D1R1\n")  # the player walked right: the box is below it
    assert env.step("D")[0].endswith("\nbox D1 goal R1\n")  # pushed down: the box is now level with the target
    assert env.step("jump")[0] == "invalid action; reply U, D, L or R\n" + env.render()
    obs, _, done, info = [env.step(a) for a in "LDR"][-1]  # around the box, and push it right
    assert info["solved"] and done and obs.endswith("box R1 goal 0\n")  # box on the target
    assert [offset((2, 2), c) for c in [(0, 2), (2, 5), (2, 2), (3, 1)]] == ["U2", "R3", "0", "D1L1"]
    level_text = load_task(TaskSection(name="sokoban", params={"hints": True})).prompts(0)[0].text
    assert level_text.endswith("\n") and level_text.split("\n")[-2].startswith("box ")  # the first prompt too


def test_sokoban_eval_levels_sets_the_held_out_count_and_keeps_the_first_levels():
    default = load_task(TaskSection(name="sokoban", params={"size": 6})).eval_prompts(3)
    more = load_task(TaskSection(name="sokoban", params={"size": 6, "eval_levels": 200})).eval_prompts(3)
    assert len(default) == 64 and len(more) == 200
    assert [p.text for p in more[:64]] == [p.text for p in default]  # a larger eval adds levels, changes none
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ConfigError, match="task.params.eval_levels must be a whole number >= 1"):
            load_task(TaskSection(name="sokoban", params={"eval_levels": bad}))


def test_sokoban_invalid_action_bump_and_max_turns():
    env = SokobanEnv(max_turns=3, step_cost=0.05, invalid_penalty=0.1, instructions=False)
    start = env.reset(Level.from_text(KNOWN))
    obs, r, done, info = env.step("jump")
    assert r == pytest.approx(-0.1) and info["invalid"] and not done
    assert obs.startswith("invalid action") and obs.endswith(start)  # nothing moved
    obs, r, done, info = env.step("U")  # into the wall: a move that goes nowhere
    assert r == pytest.approx(-0.05) and obs == start and not done
    obs, r, done, info = env.step("L")
    assert done and info["truncated"] and not info["solved"]
    assert parse_action("") is None and parse_action("north") is None and parse_action(" l ") == "L"


def test_sokoban_generated_levels_are_solvable_and_deterministic():
    task = load_task(TaskSection(name="sokoban", params={"max_turns": 30, "interior_walls": 1}))
    assert is_multi_turn(task)
    levels = task.prompts(3)
    for i in range(20):
        item = levels[i]
        assert item == task.prompts(3)[i]
        level = item.meta["level"]
        solution = level.solve()
        assert solution and level.box != level.target
        env = task.make_env()
        assert env.reset(item) == item.text
        total = 0.0
        for action in solution:
            _, r, done, info = env.step(action)
            total += r
        assert done and info["solved"]
        assert total == pytest.approx(1.0 - 0.05 * len(solution))
    assert generate_level(11) == generate_level(11)
    with pytest.raises(ValueError, match="interior_walls"):
        generate_level(0, size=4, interior_walls=3)
    with pytest.raises(TaskError, match="task.reward"):
        load_task(TaskSection(name="sokoban", reward="x.py:f"))
