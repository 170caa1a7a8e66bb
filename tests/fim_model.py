"""A model that fills in the middle, for tests and the FIM benchmark: SmolLM2 with three of
its control tokens named FIM's in its GGUF (tokenizer.ggml.fim_pre/suf/mid_token_id), as a code
model's are; llama.cpp then finds them as it finds any model's. No model of the registry has
FIM tokens."""

from __future__ import annotations

PRE, SUF, MID = 7, 8, 9     # SmolLM2's <gh_stars>, <issue_start>, <issue_comment>
REP = 4                     # its <reponame>, which llama.cpp finds by its text


def with_fim(source, out) -> None:
    """`source` (a GGUF) copied to `out` with FIM token ids in its metadata."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    u32 = gguf.GGUFValueType.UINT32
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.FIM_PRE_ID: MetadataDetails(u32, PRE),
                                            gguf.Keys.Tokenizer.FIM_SUF_ID: MetadataDetails(u32, SUF),
                                            gguf.Keys.Tokenizer.FIM_MID_ID: MetadataDetails(u32, MID)}, [])


def fim_smollm2(folder) -> str:
    """The registry's SmolLM2 with FIM ids, written into `folder`: its path."""
    from pathlib import Path

    from flylocal import models

    out = str(Path(folder) / "smollm2-fim.gguf")
    with_fim(models.local_path("smollm2-135m-instruct"), out)
    return out
