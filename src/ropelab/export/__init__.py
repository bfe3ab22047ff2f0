"""Models out of ropelab: Hugging Face folders.

  hf.py           export_hf (a run or checkpoint -> an HF folder with its tokenizer), save_hf (a model)
  remote_code.py  ropelab's own modeling code, shipped in the folder when no transformers class is
                  exactly equivalent (trust_remote_code=True)
"""
