"""Token roles of a (multi-turn) trajectory and the action mask derived from them.

A response is everything after the prompt: model tokens *and* tool observations. Only the
tokens the policy generated are actions; the loss, the KL and every advantage that is
averaged over tokens must see the action mask, never the attention mask.
"""

from __future__ import annotations

import enum

import chex
import jax
import jax.numpy as jnp


class Role(enum.IntEnum):
    """Role of one token position (store as int8/int32 arrays)."""

    PROMPT = 0
    AGENT_CALL = 1  # policy-generated tool call
    TOOL_RESULT = 2  # observation inserted by the environment
    AGENT_ANSWER = 3  # policy-generated text
    PADDING = 4


ACTION_ROLES = (Role.AGENT_CALL, Role.AGENT_ANSWER)


def action_mask(roles: chex.Array) -> jax.Array:
    """Bool mask, True exactly where the policy generated the token (``AGENT_CALL``/``AGENT_ANSWER``).

    Example: roles ``[PROMPT, AGENT_CALL, TOOL_RESULT, AGENT_ANSWER, PADDING]`` give
    ``[0, 1, 0, 1, 0]``.
    """
    chex.assert_type(roles, int)
    roles = jnp.asarray(roles)
    return (roles == Role.AGENT_CALL) | (roles == Role.AGENT_ANSWER)
