"""The paper's tables (`python -m tables.paper`): every checkpoint scored at the same seeds by each
reward, as the papers print them, over evaluate.py's generation and temperature sweep."""
