"""`CacheClipRetriever`: the engine's FAISS chunk index as a LangChain retriever.

Documents carry their chunk id (`Document.id` and `metadata["chunk_id"]`), so a chain can hand
the ids to `CacheClipLLM` (`chunk_ids=`) and skip recognition altogether.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field


class CacheClipRetriever(BaseRetriever):
    """Top-k chunks from a `CacheClipEngine`'s index."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(exclude=True)
    k: int = 4

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k = kwargs.get("k", self.k)
        docs = []
        for cid, score in self.engine.retrieve(query, k):
            chunk = self.engine.store.get_chunk(cid)
            metadata = {"chunk_id": cid, "score": score, "source": chunk.source}
            docs.append(Document(id=cid, page_content=chunk.text, metadata=metadata))
        return docs
