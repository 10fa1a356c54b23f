"""A LangChain retrieval chain with rerankit: vector search for recall, then a reranker for precision.

Runs offline on the CPU in a few seconds with the packaged all-MiniLM-L6-v2 (embeddings and reranker share one
loaded model). Rerank with another model or a server instead:

    python examples/langchain_retrieval.py --query "Who designed the Eiffel Tower?"
    python examples/langchain_retrieval.py --reranker Qwen/Qwen3-Reranker-0.6B --device cuda
    python examples/langchain_retrieval.py --reranker http://localhost:8000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from langchain_core.vectorstores import InMemoryVectorStore

from rerankit import make_backend
from rerankit.integrations.langchain import RerankitEmbeddings, RerankitRerank
from rerankit.reranker import is_url

# Twenty one-line facts, shared with the CLI example (rerankit rank --docs examples/docs.txt).
FACTS = Path(__file__).with_name("docs.txt").read_text(encoding="utf-8").splitlines()


def format_hits(documents: list[Document]) -> str:
    """The reranked documents, best first, one a line with the reranker's score."""
    return "\n".join(f"{rank}. [{document.metadata['relevance_score']:.3f}] {document.page_content}"
                     for rank, document in enumerate(documents, start=1))


def build_chain(reranker: str | None, device: str | None, candidates: int, top_n: int):
    """Retriever (MiniLM vectors, ``candidates`` hits) -> RerankitRerank (``top_n`` kept) -> formatted text."""
    minilm = make_backend(None, device=device)
    store = InMemoryVectorStore(RerankitEmbeddings(backend=minilm))
    store.add_documents([Document(page_content=fact, metadata={"line": line}) for line, fact in enumerate(FACTS)])
    if reranker is None:
        compressor = RerankitRerank(backend=minilm, top_n=top_n)
    else:
        options = {"device": device} if device and not is_url(reranker) else {}
        compressor = RerankitRerank(model=reranker, backend_options=options, top_n=top_n)
    retriever = ContextualCompressionRetriever(base_retriever=store.as_retriever(search_kwargs={"k": candidates}),
                                               base_compressor=compressor)
    return retriever | RunnableLambda(format_hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--query", default="What is the capital of France?")
    parser.add_argument("--reranker", help="reranker model path, hub id or server URL (default: the packaged MiniLM)")
    parser.add_argument("--device", help="cpu, cuda, ... (default: the GPU if there is one)")
    parser.add_argument("--candidates", type=int, default=8, help="documents the vector search hands over")
    parser.add_argument("--top-n", type=int, default=3, help="documents the reranker keeps")
    args = parser.parse_args()

    chain = build_chain(args.reranker, args.device, args.candidates, args.top_n)
    print(f"query: {args.query}")
    print(chain.invoke(args.query))


if __name__ == "__main__":
    main()
