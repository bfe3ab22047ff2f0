"""Knowledge distillation: teachers (Hugging Face, GGUF or ropelab), an offline cache of teacher
targets, and the objective the trainer runs with them. The chunked KD loss itself is
`ropelab.train.loss.kd_loss`.

  teacher.py    check_teacher / load_teacher: find, check (tokenizer, vocabulary) and load the teacher
  cache.py      cache_teacher_logits / CachedTeacher: offline KD from stored top-k log-probabilities
  objective.py  build_objective: the KD objective, registered with the trainer on import
"""

from ropelab.distill.objective import build_objective
from ropelab.train.objectives import register_objective

register_objective("distill", build_objective)
