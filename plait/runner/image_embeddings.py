"""ImageEmbeddings: the vision tower's output for the images a step's prompt chunks reach, kept from the step
that first reaches an image until the one that passes its last placeholder (chunks may split an image), and
staged each step into static buffers that eager steps and CUDA graphs alike read."""

from __future__ import annotations

import numpy as np
import torch

from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import StepPlan

# Image counts the vision tower is captured for on a GPU (a batch is padded with blank images to the next;
# more than the largest run in pieces of it). Eager, a LLaVA-1.5 tower (CLIP ViT-L, 23 layers run) took
# ~11 ms of host time a call on an H200, ten times its GPU time for one image.
TOWER_GRAPH_BATCHES = (1, 2, 4, 8, 16, 32)


class TowerGraphs:
    """An image model's ``embed_images`` captured in a CUDA graph per TOWER_GRAPH_BATCHES size, sharing one
    memory pool (largest first); the graphs keep no reference to the model."""

    def __init__(self, model: torch.nn.Module, device: torch.device, image_shape: tuple[int, ...]) -> None:
        self.sizes = TOWER_GRAPH_BATCHES
        self.inputs = torch.zeros(max(self.sizes), *image_shape, device=device)  # [images, C, H, W] fp32
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for n in sorted(self.sizes, reverse=True):
                model.embed_images(self.inputs[:n])  # warm-up: kernels chosen and loaded outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[n] = model.embed_images(self.inputs[:n])
                self.graphs[n] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    def __call__(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """Pinned host tiles [C, H, W] each -> their features [tiles, patch features, hidden]."""
        pieces = []
        for lo in range(0, len(pixels), max(self.sizes)):
            part = pixels[lo:lo + max(self.sizes)]
            for i, image in enumerate(part):
                self.inputs[i].copy_(image, non_blocking=True)
            size = next(s for s in self.sizes if s >= len(part))
            self.graphs[size].replay()
            pieces.append(self.outputs[size][:len(part)].clone())  # the next replay writes the same pool
        return torch.cat(pieces)


class ImageEmbeddings:
    """Runs an image model's ``embed_images`` for the images a step needs, once per image while its prompt
    is computed: a request preempted, or served partly from the prefix cache, embeds again what it needs.

    ``put`` writes a step's placeholder embeddings (``for_step``'s) into ``values`` and marks their tokens in
    ``mask`` (a tensor-parallel worker puts the driver's, sent with the step); the
    model takes ``views(num_tokens)`` as ``ForwardBatch.image_embeds``. The buffers never move, so graphs
    captured with them replay steps with images too (a step's writes are stream-ordered before its forward,
    and after the forward of the step before, which read the previous ones)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int, hidden: int,
                 dtype: torch.dtype, graphs: bool = False) -> None:
        self.model = model
        self.device = device
        # On a GPU outside enforce_eager, the vision tower replays CUDA graphs (TowerGraphs).
        self.tower_graphs = TowerGraphs(model, device, model.tile_shape) if graphs else None
        self.mask = torch.zeros(max_tokens, dtype=torch.bool, device=device)  # [max_tokens]
        # [max_tokens, hidden]: hidden is a placeholder row's width (the model's image_embed_width where it
        # carries more than the embedding: Qwen3-VL's DeepStack features)
        self.values = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
        self._staged = False  # whether mask marks any token (of the last step staged)
        # (request, image index) -> the image's embeddings [num_image_tokens, hidden]
        self._cache: dict[tuple[Request, int], torch.Tensor] = {}

    def views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [num_tokens] bool, values [num_tokens, hidden]): ForwardBatch.image_embeds."""
        return self.mask[:num_tokens], self.values[:num_tokens]

    def put(self, found: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Stage a step's (token indices [n], embeddings [n, hidden]) (for_step's, or on a tensor-parallel
        worker the driver's, on the host), the last step's cleared first; None: the step has none."""
        if self._staged:
            self.mask.zero_()
            self._staged = False
        if found is None:
            return
        # by device type: the driver's tensors are on cuda:0 where self.device says "cuda"
        token_indices, embeds = (self._to_device(t) if t.device.type == "cpu" else t for t in found)
        # index_fill_ / index_copy_, not item assignment: a Python value set through a device index became a
        # host tensor copied to the GPU, whose stream sync stalled each image step's launch (~10 ms, H200)
        self.mask.index_fill_(0, token_indices, True)
        self.values.index_copy_(0, token_indices, embeds.to(self.values.dtype))
        self._staged = True

    def for_step(self, plan: StepPlan, query_start_loc: np.ndarray
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices in the step [n], their embeddings [n, hidden]) for every placeholder token the
        step computes; None where it computes none."""
        self._forget_finished()
        wanted = []  # (request, image index, first and last + 1 placeholder this step, the row's first token)
        for r, row in enumerate(plan.rows):
            if not row.is_prefill or not row.request.images:
                continue
            lo, hi = row.start, row.start + row.num_new_tokens
            for k, image in enumerate(row.request.images):
                a, b = max(lo, image.offset), min(hi, image.offset + image.length)
                if a < b:
                    wanted.append((row.request, k, a, b, int(query_start_loc[r]) - lo))
        if not wanted:
            return None
        self._embed_missing([(request, k) for request, k, *_ in wanted])
        indices, parts = [], []
        for request, k, a, b, shift in wanted:
            image = request.images[k]
            lo, hi = a - image.offset, b - image.offset  # within the image's span
            if image.embedded is None:  # every token of the span a placeholder
                parts.append(self._cache[request, k][lo:hi])
                indices.append(np.arange(a + shift, b + shift))
            else:  # tile tags between the placeholders (Idefics3) keep their own embeddings
                mask = image.embedded[lo:hi]
                first = int(np.count_nonzero(image.embedded[:lo]))  # the image's embeddings before the chunk
                parts.append(self._cache[request, k][first:first + int(np.count_nonzero(mask))])
                indices.append(a + shift + np.flatnonzero(mask))
            if b == image.offset + image.length:  # the end of its span: no later chunk needs it
                del self._cache[request, k]
        token_indices = np.concatenate(indices)
        if not len(token_indices):  # the step's chunks reach only tile tags
            return None
        return self._to_device(torch.from_numpy(token_indices)), torch.cat(parts)

    def _embed_missing(self, keys: list[tuple[Request, int]]) -> None:
        missing = list(dict.fromkeys(key for key in keys if key not in self._cache))
        if not missing:
            return
        images = [request.images[k] for request, k in missing]
        if getattr(self.model, "variable_size_images", False):
            # Qwen2-VL: images of any size, their patches concatenated into one encoder call (eager)
            pixels = [self._to_device(image.pixel_values) for image in images]
            embedded = self.model.embed_image_list(pixels, [image.grid for image in images])
            for key, embeds in zip(missing, embedded):
                self._cache[key] = embeds  # [placeholders, hidden]
            return
        if self.tower_graphs is not None:
            # Pinned one tile at a time: same-sized blocks, which PyTorch's host allocator reuses.
            pinned = [tile.pin_memory() for image in images for tile in image.pixel_values]
            features = self.tower_graphs(pinned)
        else:
            tiles = torch.cat([image.pixel_values for image in images])  # [tiles, C, H, W]
            features = self.model.embed_images(self._to_device(tiles))  # [tiles, patch features, hidden]
        per_image = features.split([len(image.pixel_values) for image in images])
        for key, image, feats in zip(missing, images, per_image):
            self._cache[key] = self.model.pack_image(feats, image.size)  # [placeholders, hidden]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without waiting for the steps in flight: a copy from pageable memory
        may wait for the stream to drain (CUDA's rule for pageable copies); from pinned memory it queues, the
        pinned block held until the copy is done (PyTorch's host allocator)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _forget_finished(self) -> None:
        """Drop the images of requests that finished (or were aborted) before their last placeholder."""
        for key in [key for key in self._cache if key[0].status is RequestStatus.FINISHED]:
            del self._cache[key]

    @property
    def num_cached(self) -> int:
        """Images embedded and still awaited by a later chunk."""
        return len(self._cache)
