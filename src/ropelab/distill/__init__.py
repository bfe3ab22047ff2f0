"""Knowledge distillation (issue #6): a chunked KD loss, teachers (Hugging Face or ropelab), an
offline cache of teacher logits, and the training objectives built from them.

  loss.py       kd_loss: forward KL with temperature, top-k targets, mixed with cross-entropy, in chunks
  teacher.py    check_teacher / load_teacher: find, check (tokenizer, vocabulary) and load the teacher
  cache.py      cache_teacher_logits / CachedTeacher: offline KD from stored top-k log-probabilities
  objective.py  build_objective: the run's loss (CE or KD) in one call shape for the trainer
"""
