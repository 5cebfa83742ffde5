// The Run button under each standard-library experiment's listing: the file,
// unchanged and editable, runs in the browser (Pyodide in a web worker, see
// run-worker.js), and its output is shown beside the recorded one. The torch
// experiment and the engine demos get the command that runs them locally.
// The list of what can run comes from assets/experiments/index.json, which the
// build writes (docs/hooks/run_in_page.py).
let worker = null;
let nextId = 0;
const pending = new Map();

// The site's root, from this script's own address (assets/javascripts/): the
// page's relative base would go stale under Material's instant navigation.
const SITE_ROOT = new URL("../../", document.currentScript.src);

function siteBase() {
  return SITE_ROOT;
}

function run(base, source, path) {
  if (!worker) {
    worker = new Worker(new URL("assets/javascripts/run-worker.js", base), { type: "module" });
    worker.onmessage = ({ data }) => { pending.get(data.id)(data); pending.delete(data.id); };
  }
  const id = nextId++;
  return new Promise((resolve) => {
    pending.set(id, resolve);
    worker.postMessage({ id, source, path });
  });
}

function diff(got, want) {
  const a = got.split("\n"), b = want.split("\n");
  const lines = [];
  for (let i = 0; i < Math.max(a.length, b.length); i++) {
    if (a[i] === b[i] || (b[i]?.startsWith("~") && a[i] !== undefined)) continue;  // "~": varies by machine
    if (b[i] !== undefined) lines.push(`- ${b[i]}`);
    if (a[i] !== undefined) lines.push(`+ ${a[i]}`);
  }
  return lines.join("\n");
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function note(entry) {
  const panel = element("div", "run-panel run-local");
  panel.append(element("span", "", entry.why + " Run it from the repository's root: "));
  panel.append(element("code", "", entry.command));
  return panel;
}

function runner(base, path, entry) {
  const panel = element("div", "run-panel");
  const button = element("button", "md-button run-button", "Run it here");
  panel.append(button);
  button.addEventListener("click", async () => {
    if (!panel.querySelector("textarea")) {
      const source = await (await fetch(new URL(entry.source, base))).text();
      const editor = element("textarea", "run-source");
      editor.value = source;
      editor.spellcheck = false;
      editor.rows = 12;
      editor.setAttribute("aria-label", `The source of ${path}, to edit and run`);
      panel.insertBefore(editor, button);
      panel.append(element("div", "run-status"), element("pre", "run-output"));
    }
    const status = panel.querySelector(".run-status");
    const output = panel.querySelector(".run-output");
    button.disabled = true;
    delete status.dataset.same;  // set again when this run's output is in
    status.textContent = worker ? "Running…" : "Loading Python (once per page), then running…";
    const [result, recorded] = await Promise.all([
      run(base, panel.querySelector("textarea").value, path),
      fetch(new URL(entry.out, base)).then((r) => r.text()),
    ]);
    output.textContent = result.out;
    const changes = diff(result.out, recorded);
    status.dataset.same = String(!changes);
    status.textContent = result.failed
      ? "It raised an error (above)."
      : !changes
        ? `Same as the recorded output (Python ${result.python} in your browser).`
        : "Different from the recorded output; what changed (- recorded, + yours):";
    panel.querySelector(".run-diff")?.remove();
    if (changes) output.after(element("pre", "run-diff", changes));
    button.disabled = false;
    button.textContent = "Run again";
  });
  return panel;
}

document$.subscribe(async () => {
  const names = document.querySelectorAll(".highlight span.filename");
  if (!names.length) return;
  const base = siteBase();
  const index = await (await fetch(new URL("assets/experiments/index.json", base))).json();
  for (const name of names) {
    const path = name.textContent.trim();
    const entry = index.files[path];
    const listing = name.closest("details") ?? name.closest(".highlight");
    if (!entry || listing.nextElementSibling?.classList.contains("run-panel")) continue;
    listing.after(entry.runs_here && index.pyodide ? runner(base, path, entry) : note(entry));
  }
});
