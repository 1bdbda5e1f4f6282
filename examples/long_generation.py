"""A long generation against a FreeKV server, with SGLang's frontend language (sgl.function, sgl.gen).

Generates more tokens than FreeKV keeps on the GPU per request (sink + budget + window = 2688 tokens with the
defaults), so most of the decode steps attend to selected pages. --stream prints the text as it arrives.

    bash examples/launch_freekv_server.sh      # MODEL=... ; in another shell:
    python examples/long_generation.py --url http://127.0.0.1:30000 --max-tokens 4096
"""

from __future__ import annotations

import argparse
import sys

import sglang as sgl


@sgl.function
def long_story(s, topic, max_tokens):
    s += sgl.system("You are a novelist. Write long, detailed chapters and never stop early.")
    s += sgl.user(f"Write a long story about {topic}. Give every chapter a title and many scenes.")
    s += sgl.assistant(sgl.gen("story", max_tokens=max_tokens, temperature=0.7, top_p=0.95))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server (default %(default)s)")
    p.add_argument("--topic", default="a lighthouse keeper who finds a map in a bottle")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--stream", action="store_true", help="print the story while it is generated")
    args = p.parse_args(argv)

    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    state = long_story.run(topic=args.topic, max_tokens=args.max_tokens, stream=args.stream)
    if args.stream:
        for chunk in state.text_iter(var_name="story"):
            sys.stdout.write(chunk)
            sys.stdout.flush()
        print()
    else:
        print(state["story"])
    meta = state.get_meta_info("story") or {}
    print(f"\n[{meta.get('completion_tokens', '?')} tokens generated, prompt {meta.get('prompt_tokens', '?')}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
