"""experiments/field_estimators.py: the field's turn-level advantage estimators, each as its source computes it.

What it holds
  One function per estimator, each with 04's estimator signature, fn(rewards, dialogues, args) -> (A, A_terms),
  so that 04 (and the credit playground) runs it with no edit of either (issue 67, item 1), as
  `--advantage experiments.field_estimators:<function>`:
    mt_grpo_advantages        Atropos's MT-GRPO
    step_loo_advantages       PipelineRL's step leave-one-out (PR #135)
    ctc_grpo_advantages       EIBench's CTC-GRPO (its code could not be found: from the issue's one-line description)
    gigpo_advantages          verl-agent's GiGPO
    turn_credit_advantages    prime-rl's turn_credit (PR #3282, open)
  (run from the repository's root: 04 finds the folder experiments/ there). Each function's docstring names its
  source's repository, file and commit, what the source computes, and where this version departs. The code was read,
  not copied: each is written again as a loop whose names follow its equation, the equation in a comment above it.
  The defaults are the sources' and are constants below, not flags: 04's --gamma and --alpha are not read.
  verl RFC #7244's correction is not here: only the first part of its thread could be read (the claim), not the
  fix it describes at its bottom.

The mapping from EMPA's names, once for all of them (rewards[s][k][t] and dialogues[s][k] as 04 passes them; t
counts replies from 0, and reply t answers the state P_t = dialogue.states[t] and moves it to states[t + 1])
  r_t     a turn's reward (a step reward, MT-GRPO's turn reward R^T): 04's `rewards`, the --reward of the run
          (idr: d(P_t) - d(P_{t+1}), less the cut-off penalty where the reply was cut off)
  R_k     a dialogue's outcome (MT-GRPO's R^O, CTC-GRPO's trace reward, GiGPO's episode reward, turn_credit's
          final reward): the dialogue's return sum_t r_t, as 04's GRPO takes it (idr with no cut-off: d(P_0) -
          d(P_T)). Not success: no dialogue of 04's cpu preset can succeed (docs/course.md, lesson 1), so an
          outcome of success would be 0 for every dialogue and every outcome term with it
  p_t     a turn's local score (CTC-GRPO's per-turn state update): r_t
  phi_t   a state's score (turn_credit's per-turn state-of-the-world score): -d(P_t), 03's hinge distance of
          dialogue.states[t] with --idr-weights and 03's eps (EPS); the score after reply t is phi_{t+1}
  s_t     reply t's anchor state (GiGPO's anchor observation): P_t, the judge's state the reply answers, each
          axis rounded to 2 decimals. It is the environment's whole state without the dialogue's history (what
          GiGPO's anchor is: the observation without the history); the text of the user's turn differs between
          sampled dialogues even where the state is the same, so a text anchor would group only the first turn.
          Rounded because P moves by whole points from the scenario's P_0, so two paths to the same point may
          differ in the last bits of a float sum; 2 decimals as 03's episode rules round the state
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import common  # noqa: E402

env = importlib.import_module("03_rollout")  # the hinge distance d(P) and its eps: the state score phi_t

# the sources' defaults (each function's docstring says where each one is set)
MT_GRPO_LAMBDA = 1.0  # Atropos: turn_level_advantage_lambda
STEP_LOO_DIVIDE_BY_STD = True  # PipelineRL: RLConfig.divide_advantage_by_std (conf/finetune/base.yaml sets false)
STEP_LOO_EPS = 1e-4  # PipelineRL: the std's epsilon
CTC_ALPHA, CTC_STD_FLOOR, CTC_EPS = 15.0, 0.1, 1e-6  # CTC-GRPO (the line); verl's GRPO epsilon
GIGPO_GAMMA, GIGPO_W = 0.95, 1.0  # verl-agent: algorithm.gamma of its example scripts, gigpo.step_advantage_w
TURN_CREDIT_GAMMA, TURN_CREDIT_BETA = 0.9, 1.0  # prime-rl: TurnCreditAlgoConfig's gamma and beta


def outcome(r) -> float:
    # R_k = sum_t r_t  (the mapping above)
    return sum(r)


def state_score(P, args) -> float:
    # phi(P) = -d(P),  d = 03's hinge distance with --idr-weights and eps = 03's EPS
    return -env.hinge_distance(P, args.idr_weights, env.EPS)


def anchor_state(P) -> tuple:
    # s = P with each axis rounded to 2 decimals (the mapping above)
    return tuple(round(x, 2) for x in P)


# ---------------------------------------------------------------------------------------------
# MT-GRPO (Atropos)
# ---------------------------------------------------------------------------------------------
def mt_grpo_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """MT-GRPO as Atropos computes it: per turn index, each turn reward standardised over the group's K dialogues,
    plus lambda times the standardised outcome.

    Source: NousResearch/atropos, environments/tool_use_turnlevel_advantage_server.py,
    `BaseMTGRPOEnv._compute_mt_grpo_advantages` (the file as of commit
    cd733d428576a4d7ca8b5e6af62ed415652109bf, unchanged at the repository's head 296a0bc5); lambda is
    `turn_level_advantage_lambda`, default 1.0 (MTGRPOEnvConfig). After MT-GRPO (Zeng et al., arXiv 2505.11821),
    Eq. 7. The source's statistics: numpy's mean and std (the population std), a std of 0 taken as 1; a dialogue
    that did not reach turn t counts at turn t with a reward of 0, and gets an advantage only for the turns it has.
    Departures: none in the arithmetic. The source's own environment pads every dialogue's turn rewards with 0 up
    to the task's number of turns before this step (and trains the padded turns' advantages on no tokens); 04's
    dialogues are not padded, which gives the same numbers on the turns that exist. Its outcome is success (1 or 0)
    by default; here R_k (the mapping)."""
    A, A_turn_all, A_outcome_all = [], [], []
    for group in rewards:
        K = len(group)
        # the outcome term: A^O_k = (R_k - mean_K R) / std_K R, std the population std, 1 where it is 0
        R = [outcome(r) for r in group]
        mean_R, std_R = common.mean_std(R, ddof=0)
        std_R = std_R if std_R != 0 else 1.0
        A_O = [(R[k] - mean_R) / std_R for k in range(K)]
        # the turn term: A^T_k,t = (r_k,t - mean_t) / std_t over all K dialogues, r_k,t = 0 where k ended before t
        A_T = [[0.0] * len(group[k]) for k in range(K)]
        for t in range(max(len(r) for r in group)):
            r_t = [group[k][t] if len(group[k]) > t else 0.0 for k in range(K)]
            mean_t, std_t = common.mean_std(r_t, ddof=0)
            std_t = std_t if std_t != 0 else 1.0
            for k in range(K):
                if len(group[k]) > t:
                    A_T[k][t] = (r_t[k] - mean_t) / std_t
        # A_k,t = A^T_k,t + lambda A^O_k
        A.append([[A_T[k][t] + MT_GRPO_LAMBDA * A_O[k] for t in range(len(group[k]))] for k in range(K)])
        A_turn_all.append(A_T)
        A_outcome_all.append([[MT_GRPO_LAMBDA * A_O[k]] * len(group[k]) for k in range(K)])
    return A, {"A_turn": A_turn_all, "A_outcome": A_outcome_all}


# ---------------------------------------------------------------------------------------------
# Step leave-one-out (PipelineRL #135)
# ---------------------------------------------------------------------------------------------
def step_loo_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """PipelineRL's multi-step advantage: per (group, turn index), each step's reward against the mean of the other
    dialogues' rewards at that turn index, over the dialogues that reached it, divided by the std of them all.

    Source: ServiceNow/PipelineRL, pipelinerl/finetune/rl/__init__.py, `populate_rl_data`, as PR #135 ("Multi-Step
    RL") merged it: merge commit 58d393458625ad63ed539f2dcd072c85700c557f (the per-step grouping came in f40440e7,
    "Allow step rewards"). Each step (`step_index`) of a rollout is its own row, its reward the first of the row's
    `rewards`; the rows are grouped by (group_id, step_index), so only the rollouts that took step t meet at t.
    With N_t of them: the baseline is (sum - r) / (N_t - 1), and r itself (an advantage of 0) when N_t = 1; the std
    is pandas' (the sample std, NaN for one row, then 0 by nan_to_num), taken over all N_t rewards, this one
    included; A = (r - baseline) / (std + 1e-4) with `divide_advantage_by_std`, RLConfig's default True (the same
    file; conf/finetune/base.yaml sets it false, and A = r - baseline). No episode term.
    Departures: none. r_t is 04's per-turn reward (in the PR's own tir domain every step carries the rollout's
    final reward; the function takes whatever reward each step has)."""
    A, baseline_all = [], []
    for group in rewards:
        K = len(group)
        A_s = [[0.0] * len(group[k]) for k in range(K)]
        b_s = [[0.0] * len(group[k]) for k in range(K)]
        for t in range(max(len(r) for r in group)):
            reached = [k for k in range(K) if len(group[k]) > t]
            N_t = len(reached)
            total = sum(group[k][t] for k in reached)
            # std_t = sqrt( sum_k (r_k,t - mean_t)^2 / (N_t - 1) ) over the N_t that reached t; 0 when N_t = 1
            std_t = common.mean_std([group[k][t] for k in reached], ddof=1)[1] if N_t > 1 else 0.0
            for k in reached:
                r = group[k][t]
                # b_k,t = (sum_{j reached t} r_j,t - r_k,t) / (N_t - 1);  b = r_k,t when N_t = 1
                b = (total - r) / (N_t - 1) if N_t > 1 else r
                # A_k,t = (r_k,t - b_k,t) / (std_t + 1e-4)
                A_s[k][t] = (r - b) / (std_t + STEP_LOO_EPS) if STEP_LOO_DIVIDE_BY_STD else r - b
                b_s[k][t] = b
        A.append(A_s)
        baseline_all.append(b_s)
    return A, {"baseline": baseline_all}


# ---------------------------------------------------------------------------------------------
# CTC-GRPO (EIBench): the source's code could not be found
# ---------------------------------------------------------------------------------------------
def ctc_grpo_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """CTC-GRPO (Centered Turn-Credit GRPO, EIBench, arXiv 2606.15532): a trace-level GRPO term plus alpha times each
    turn's score centred within its own dialogue.

    Source NOT FOUND. The issue names `compute_prompt_trace_grpo_advantage` in Tongyi-ConvAI/Qwen-Character; no file
    of the repository read holds it: neither its history to 1de87a220bc06fb8402c7680809f7e5e4b49f4ea (fetched) nor
    the files the code index keeps from commits that snapshot lacks (EIBench/code/training/ at af8994a4 and
    34e8b967, whose trainer core is not among them; code/training/verl/trainer/ppo/core_algos.py at
    d46d20f046b996b22db91d66a250837ee053d82a). The paper's method section could not be read either (its abstract
    only). So this is written from the issue's one line,
    "A_trace (the dialogue's outcome, z over the group, sd floored at 0.1) + alpha (p_t - the mean of p over the same
    dialogue's turns), alpha 15", and the choices that line leaves open are taken from the GRPO of the repository's
    own verl (core_algos.py at d46d20f0, `compute_grpo_outcome_advantage`, whose `grpo_std_min` clamps the group std
    from below, its default 0): the sample std (torch.std), clamped at 0.1, then + 1e-6; a group of one: mean 0 and
    std 1. Check it against the source where that can be read."""
    A, A_trace_all, A_turn_all = [], [], []
    for group in rewards:
        K = len(group)
        # A_trace_k = (R_k - mean_K R) / (max(std_K R, 0.1) + 1e-6), std the sample std; R_k itself when K = 1
        R = [outcome(r) for r in group]
        mean_R, std_R = common.mean_std(R, ddof=1) if K > 1 else (0.0, 1.0)
        A_trace = [(R[k] - mean_R) / (max(std_R, CTC_STD_FLOOR) + CTC_EPS) for k in range(K)]
        # A_turn_k,t = alpha (p_k,t - (1 / T_k) sum_t' p_k,t'),  p_k,t = r_k,t
        A_turn = []
        for k in range(K):
            p = group[k]
            p_mean = sum(p) / len(p) if p else 0.0
            A_turn.append([CTC_ALPHA * (p[t] - p_mean) for t in range(len(p))])
        # A_k,t = A_trace_k + A_turn_k,t
        A.append([[A_trace[k] + A_turn[k][t] for t in range(len(group[k]))] for k in range(K)])
        A_trace_all.append([[A_trace[k]] * len(group[k]) for k in range(K)])
        A_turn_all.append(A_turn)
    return A, {"A_trace": A_trace_all, "A_turn": A_turn_all}


# ---------------------------------------------------------------------------------------------
# GiGPO (verl-agent)
# ---------------------------------------------------------------------------------------------
def gigpo_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """GiGPO (Feng et al., arXiv 2505.10978) as verl-agent computes it: an episode term, each dialogue's outcome
    against the group's mean, plus w times a step term, each turn's discounted return against the mean return of
    the group's turns taken from the same anchor state, at whatever turn index.

    Source: langfengQ/verl-agent, gigpo/core_gigpo.py, `compute_gigpo_outcome_advantage` with `episode_norm_reward`,
    `build_step_group`, `step_norm_reward`, and `compute_step_discounted_returns` for the step returns; the file at
    upstream commit a64f4e0905690823b21c4244354bfef63980b8f4 (Lang Feng, #90; read from the fork
    zhangyun04/verl-agent, as langfengQ/verl-agent itself could not be fetched here); the copy of a later version
    the code index keeps (fork Elrond1701/verl-agent, 7d45a234) computes the same with the same defaults.
    Defaults: mode "mean_norm" (the function's and verl/trainer/config/ppo_trainer.yaml's: no division by a std),
    step_advantage_w 1.0, gamma 0.95 (every GiGPO example script in the repository and the paper; the trainer
    config's own default is 1.0), compute_mean_std_cross_steps True (the only value the source passes).
    What the source computes: every step is a row carrying its episode's reward R_k; the episode mean is taken
    over all the group's rows, so a dialogue weighs by its number of turns (sum_k T_k R_k / sum_k T_k), and a group
    of one row has mean 0. The step returns G_t = sum_{j >= t} gamma^(j - t) r_j use the step rewards r_t. Anchor
    groups are formed within a scenario group by identical anchor observations; a group of one gets A_step = 0.
    Departures: none in the arithmetic; the anchor is EMPA's state P_t (the mapping). With --advantage its names
    are A_episode and A_step (w A_step)."""
    A, A_episode_all, A_step_all = [], [], []
    for s, group in enumerate(rewards):
        K = len(group)
        # the episode term: A_ep_k = R_k - mean of R over the group's rows, one row a turn (0 for a group of one row)
        R = [outcome(r) for r in group]
        rows = [R[k] for k in range(K) for _ in range(len(group[k]))]
        mean_R = sum(rows) / len(rows) if len(rows) > 1 else 0.0
        A_episode = [R[k] - mean_R for k in range(K)]
        # the step returns: G_k,t = r_k,t + gamma G_k,t+1
        G = [discounted(group[k], GIGPO_GAMMA) for k in range(K)]
        # the anchor groups: the (k, t) whose reply answered the same state s_k,t = P_t
        anchors = {}
        for k in range(K):
            for t in range(len(group[k])):
                anchors.setdefault(anchor_state(dialogues[s][k].states[t]), []).append((k, t))
        # the step term: A_step_k,t = G_k,t - mean of G over its anchor group (0 for a group of one)
        A_step = [[0.0] * len(group[k]) for k in range(K)]
        for members in anchors.values():
            mean_G = sum(G[k][t] for k, t in members) / len(members)
            for k, t in members:
                A_step[k][t] = G[k][t] - mean_G
        # A_k,t = A_ep_k + w A_step_k,t
        A.append([[A_episode[k] + GIGPO_W * A_step[k][t] for t in range(len(group[k]))] for k in range(K)])
        A_episode_all.append([[A_episode[k]] * len(group[k]) for k in range(K)])
        A_step_all.append([[GIGPO_W * x for x in A_step[k]] for k in range(K)])
    return A, {"A_episode": A_episode_all, "A_step": A_step_all}


def discounted(r, gamma) -> list[float]:
    # G_t = sum_{j >= t} gamma^(j - t) r_j, backwards: G_t = r_t + gamma G_{t+1}
    G, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running
        G[t] = running
    return G


# ---------------------------------------------------------------------------------------------
# turn_credit (prime-rl PR #3282, open)
# ---------------------------------------------------------------------------------------------
def turn_credit_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """prime-rl's turn_credit: a group-centred level, the outcome plus the dialogue's net state progress, plus beta
    times each turn's share of the progress, smeared backwards with gamma and centred over the dialogue's tokens.

    Source: PrimeIntellect-ai/prime-rl, pull request #3282 (open; its head 0d6024432d2d62ebfc5f7c99a6a1fea45139a91b,
    "feat(orchestrator): turn-credit shaping algorithm"), src/prime_rl/orchestrator/algo/turn_credit.py
    (`TurnCreditAlgorithm.score_group`, `deltas`, `smear`, `_token_advantages`); gamma 0.9 and beta 1.0 are
    TurnCreditAlgoConfig's (packages/prime-rl-configs/src/prime_rl/configs/algorithm.py), no length penalty.
    What the source computes, per dialogue: its env scores the state after each turn, phi_1 .. phi_T; the progress
    of turn 1 is 0 (the first scored state is the start) and of turn t > 1 phi_t - phi_{t-1}; the level is
    (R + net) - the group's mean of it, net = the sum of the progress (phi_T - phi_1), no std; each turn's progress is
    spread over it and the turns before it with weights gamma^d summing to 1, c_t = v_t + gamma c_{t+1} with
    v_t = progress_t / sum_{d < t} gamma^d; c_bar is the mean of c over the dialogue's trainable tokens.
    Departures: each turn's tokens are the reply's span (tr.spans); where a dialogue has no spans (the credit
    playground's), each turn weighs 1. The loss's mask is not seen here, so a failed turn's tokens still count in
    c_bar. With idr the outcome R (d(P_0) - d(P_T)) and the net progress (d(P_1) - d(P_T)) count the progress after
    turn 1 twice in the level: that is the source's level under this project's one mapping."""
    A, level_all, shift_all = [], [], []
    for s, group in enumerate(rewards):
        K = len(group)
        progress, net = [], []
        for k in range(K):
            T = len(group[k])
            # the state scores after each reply: phi_t = -d(P_t), t = 1 .. T
            phi = [state_score(dialogues[s][k].states[t], args) for t in range(1, T + 1)]
            # progress_1 = 0;  progress_t = phi_t - phi_{t-1}
            progress.append([0.0] + [phi[t] - phi[t - 1] for t in range(1, T)])
            net.append(sum(progress[k]))
        # level_k = (R_k + net_k) - (1 / K) sum_j (R_j + net_j)
        ret = [outcome(group[k]) + net[k] for k in range(K)]
        level = [ret[k] - sum(ret) / K for k in range(K)]
        A_s, level_s, shift_s = [], [], []
        for k in range(K):
            T = len(group[k])
            # c_t = v_t + gamma c_{t+1},  v_t = progress_t / z_t,  z_t = sum_{d=0}^{t-1} gamma^d  (t from 1)
            c = [0.0] * T
            running = 0.0
            for t in reversed(range(T)):
                z = t + 1 if TURN_CREDIT_GAMMA == 1 else (1 - TURN_CREDIT_GAMMA ** (t + 1)) / (1 - TURN_CREDIT_GAMMA)
                running = progress[k][t] / z + TURN_CREDIT_GAMMA * running
                c[t] = running
            # c_bar = sum_t n_t c_t / sum_t n_t,  n_t = the reply's tokens (1 each without spans)
            spans = dialogues[s][k].spans
            n = [end - start for start, end in spans] if len(spans) == T else [1] * T
            c_bar = sum(n[t] * c[t] for t in range(T)) / sum(n) if sum(n) > 0 else 0.0
            # A_k,t = level_k + beta (c_t - c_bar)
            shift = [TURN_CREDIT_BETA * (c[t] - c_bar) for t in range(T)]
            A_s.append([level[k] + shift[t] for t in range(T)])
            level_s.append([level[k]] * T)
            shift_s.append(shift)
        A.append(A_s)
        level_all.append(level_s)
        shift_all.append(shift_s)
    return A, {"level": level_all, "shift": shift_all}


ESTIMATORS = {
    "mt_grpo": mt_grpo_advantages,
    "step_loo": step_loo_advantages,
    "ctc_grpo": ctc_grpo_advantages,
    "gigpo": gigpo_advantages,
    "turn_credit": turn_credit_advantages,
}
