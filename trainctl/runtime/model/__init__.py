"""The bundled trainer's model.

    transformer.py    the decoder-only transformer (GPT-2 and Llama-style variants)
    moe.py            the mixture-of-experts MLP
    parallel_context.py  what the layers know of the parallel layout (TP, CP, MoE), as one object
    init.py           initialisation independent of the parallel layout
    hf_weights.py     weights in and out in Hugging Face's format
"""
