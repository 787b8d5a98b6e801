"""`ChatCacheClip` (a LangChain `BaseChatModel`): langchain-tests' standard unit suite, and the
real engine (tiny models) behind it: chat template, reuse of stuffed context, streaming, async."""

import asyncio

import pytest
from conftest import CORPUS
from langchain_cacheclip import ChatCacheClip
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

QUESTION = "what is the code in the kitchen drawer?"


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory):
    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

    eng = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("chat"),
                          EngineConfig(chunk=ChunkConfig(chunk_tokens=16, overlap_tokens=2), packets=None))
    eng.ids = eng.ingest(CORPUS, progress=False)
    return eng


class TestChatCacheClipStandard(ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _engine(self, engine):
        self._tiny_engine = engine

    @property
    def chat_model_class(self):
        return ChatCacheClip

    @property
    def chat_model_params(self):
        return {"engine": self._tiny_engine, "max_new_tokens": 4}

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False


def test_stuffed_context_is_reused_and_matches_the_engine(engine):
    texts = [t for _, t in engine.chunk_texts(engine.ids[:2])]
    messages = [SystemMessage("Context:\n" + "\n\n".join(texts)), HumanMessage(QUESTION)]
    chat = ChatCacheClip(engine=engine, max_new_tokens=6, recompute_ratio=0.5)
    reply = chat.invoke(messages)
    expected = engine.chat([{"role": "system", "content": "Context:\n" + "\n\n".join(texts)},
                            {"role": "user", "content": QUESTION}], max_new_tokens=6, recompute_ratio=0.5)
    assert reply.content == expected.text
    assert reply.response_metadata["reused_chunk_ids"] == engine.ids[:2]
    assert reply.usage_metadata["output_tokens"] == expected.generated_tokens
    streamed = "".join(c.content for c in chat.stream(messages))
    assert streamed == expected.text


def test_multi_turn_and_async(engine):
    chat = ChatCacheClip(engine=engine, max_new_tokens=4)
    turns = [HumanMessage("hello"), AIMessage("hi"), HumanMessage(QUESTION)]
    sync = chat.invoke(turns).content

    async def run():
        text = "".join([c.content async for c in chat.astream(turns)])
        return text, (await chat.ainvoke(turns)).content

    assert asyncio.run(run()) == (sync, sync)


def test_bare_question_uses_engine_retrieval_and_bad_messages_are_refused(engine):
    chat = ChatCacheClip(engine=engine, max_new_tokens=2, k=2)
    assert len(chat.invoke(QUESTION).response_metadata["reused_chunk_ids"]) == 2
    with pytest.raises(ValueError, match="ToolMessage"):
        chat.invoke([HumanMessage(QUESTION), ToolMessage("x", tool_call_id="1")])
    with pytest.raises(ValueError, match="last message"):
        chat.invoke([HumanMessage(QUESTION), AIMessage("so")])
    with pytest.raises(ValueError, match="unknown options"):
        chat.invoke(QUESTION, nonsense=1)
