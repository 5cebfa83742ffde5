// Runs an experiment's Python in Pyodide, in this worker, off the page's thread.
// Pyodide is served by the site itself (assets/vendor/pyodide/); nothing is
// fetched from anywhere else. Loaded on the first Run, then kept for the page.
import { loadPyodide } from "../vendor/pyodide/pyodide.mjs";

let pyodide = null;

async function ready() {
  pyodide ??= loadPyodide({ indexURL: new URL("../vendor/pyodide/", import.meta.url).href });
  return pyodide;
}

self.onmessage = async ({ data: { id, source, path } }) => {
  const py = await ready();
  const decoder = new TextDecoder();
  let out = "";
  const write = (buffer) => { out += decoder.decode(buffer, { stream: true }); return buffer.length; };
  py.setStdout({ write });
  py.setStderr({ write });
  const globals = py.toPy({ __name__: "__main__", __file__: path });
  let failed = false;
  try {
    py.runPython(source, { globals, filename: path });
  } catch (err) {
    failed = true;
    out += String(err.message ?? err);
  } finally {
    globals.destroy();
  }
  const python = py.runPython("import sys; sys.version.split()[0]");
  self.postMessage({ id, out, failed, python });
};
