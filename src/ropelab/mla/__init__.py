"""Multi-head latent attention for converted models (MHA2MLA, Ji et al. 2025, arXiv 2502.14837): a cache that
holds a low-rank latent and the kept RoPE pairs instead of keys and values.

  attention.py   LatentAttention: the layer of a `model.mla` model, materialised (training) or absorbed
                 (generation over the latent cache); set_absorb; latent_cache_values
  convert.py     a selected-pair model's keys and values turned into the latent by SVD (joint or split)
  memory.py      cache bytes per token of MHA/GQA against MLA, per budget and context length
"""
