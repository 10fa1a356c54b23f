"""A LlamaIndex pipeline with rerankit: a vector index retrieves candidates, RerankitRerank keeps the best.

Runs offline on the CPU in a few seconds with the packaged all-MiniLM-L6-v2 (embeddings and reranker share one
loaded model); the query engine uses LlamaIndex's MockLLM, so no LLM is needed. Rerank with another model or a
server instead:

    python examples/llamaindex_pipeline.py --query "Which river flows through Paris?"
    python examples/llamaindex_pipeline.py --reranker Qwen/Qwen3-Reranker-0.6B --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index.core.schema import NodeWithScore

from rerankit import make_backend
from rerankit.integrations.llama_index import RerankitEmbedding, RerankitRerank
from rerankit.reranker import is_url

# Twenty one-line facts, shared with the CLI example (rerankit rank --docs examples/docs.txt).
FACTS = Path(__file__).with_name("docs.txt").read_text(encoding="utf-8").splitlines()


def show(title: str, nodes: list[NodeWithScore]) -> None:
    print(title)
    for rank, hit in enumerate(nodes, start=1):
        print(f"  {rank}. [{hit.score:.3f}] {hit.node.get_content()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--query", default="What is the capital of France?")
    parser.add_argument("--reranker", help="reranker model path, hub id or server URL (default: the packaged MiniLM)")
    parser.add_argument("--device", help="cpu, cuda, ... (default: the GPU if there is one)")
    parser.add_argument("--candidates", type=int, default=8, help="nodes the vector search hands over")
    parser.add_argument("--top-n", type=int, default=3, help="nodes the reranker keeps")
    args = parser.parse_args()

    minilm = make_backend(None, device=args.device)
    index = VectorStoreIndex.from_documents([Document(text=fact) for fact in FACTS],
                                            embed_model=RerankitEmbedding(backend=minilm))
    if args.reranker is None:
        reranker = RerankitRerank(backend=minilm, top_n=args.top_n)
    else:
        options = {"device": args.device} if args.device and not is_url(args.reranker) else {}
        reranker = RerankitRerank(model=args.reranker, backend_options=options, top_n=args.top_n)

    # Step by step: retrieve candidates, then rerank them.
    candidates = index.as_retriever(similarity_top_k=args.candidates).retrieve(args.query)
    print(f"query: {args.query}")
    show(f"reranked (top {args.top_n} of {len(candidates)} retrieved):",
         reranker.postprocess_nodes(candidates, query_str=args.query))

    # The same inside an async query engine: the reranker runs as a node postprocessor (scored with ascore).
    query_engine = index.as_query_engine(similarity_top_k=args.candidates, node_postprocessors=[reranker],
                                         llm=MockLLM())
    response = asyncio.run(query_engine.aquery(args.query))
    show("query engine sources:", response.source_nodes)


if __name__ == "__main__":
    main()
