"""Serving: the engine behind HTTP, keys, replicas and the RAG frameworks.

server.py (the OpenAI-compatible FastAPI app and its page, web/), access.py (API keys),
replicas.py (Ray Serve deployments), routing.py (chunk-affinity request routing),
frameworks.py (what the LangChain and LlamaIndex adapters share).
"""
