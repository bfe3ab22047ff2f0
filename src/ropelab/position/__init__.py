"""The modules of the position encodings registered in `ropelab.config.position`, found by `type`.

  alibi.py   Alibi: ALiBi's score bias (Press et al. 2022)
  fope.py    FourierEmbedding: FoPE's clipped, Fourier-mixed rotation (Hua et al. 2024)

  registry.py  the modules by type, the rebuild hook and the learned parameters:

  ROTATIONS[type](rope, spec, head_dim, kv_heads)  the layer's q/k transform (a `RotaryEmbedding`)
  SCORE_BIASES[type](spec, n_head)                 a module whose `bias(distance)` (query token index
                                                   - key token index) is added to the attention scores,
                                                   (H, ...), and `score_mod()` flex's (`ropelab.attention_bias`)
  ATTENTIONS[type](spec, n_head)                   a module called instead of `ropelab.attention.attend`,
                                                   with its arguments: (q, k, v, doc_ids, backend, window,
                                                   key_start, score_bias) -> (B, H, Tq, D)
  rebuild_after_meta(model)                        every encoding's `rebuild_after_meta()`: its non-weight
                                                   tensors computed again after the model was built on
                                                   the meta device (they hold uninitialised memory then)
  position_parameters(model)                       the parameters of encodings declared `learned` (each
                                                   module names its registered `position_type`)

A method registered in `ropelab.config.position` without its module here fails
tests/position/test_conformance.py, not a user.
"""

from ropelab.position.registry import ATTENTIONS, ROTATIONS, SCORE_BIASES, position_parameters, rebuild_after_meta

__all__ = ["ATTENTIONS", "ROTATIONS", "SCORE_BIASES", "position_parameters", "rebuild_after_meta"]
